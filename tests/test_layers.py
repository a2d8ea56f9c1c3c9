"""The package's layering, checked with import-linter (the contracts live in pyproject.toml): a future import
that reaches up a layer, couples the runtime and the simulator, makes a policy read a clock, or closes an
import cycle fails here."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache", "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "4 kept, 0 broken" in out.stdout, out.stdout[-2000:]


def test_no_module_is_much_over_400_lines():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in (ROOT / "fate_lab").rglob("*.py")
             if "__pycache__" not in p.parts}  # (the replay's per-policy files are written there: generated text)
    big = {p: n for p, n in sizes.items() if n > 420}
    assert not big, f"modules over ~400 lines (split them by idea): {big}"
