"""Every command-line option says what it does: each `add_argument` call in the scripts has help text.

Parses (without importing) every script under benchmarks/ and scripts/ and fate_lab/cli.py, and checks that
each `add_argument(...)` passes `help=`: a non-empty string (or a name the same file assigns one to), a string
built at run time (f-string, concatenation, a call), or `argparse.SUPPRESS` for an option hidden on purpose.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py"), ROOT / "fate_lab" / "cli.py"])


def _text(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(node.value.strip())


def _offenders(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    named = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _text(n.value)
             for t in n.targets if isinstance(t, ast.Name)}
    out = []
    for c in ast.walk(tree):
        if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument"):
            continue
        h = next((k.value for k in c.keywords if k.arg == "help"), None)
        if not (_text(h) or isinstance(h, (ast.JoinedStr, ast.BinOp, ast.Call))
                or (isinstance(h, ast.Name) and h.id in named)
                or (isinstance(h, ast.Attribute) and h.attr == "SUPPRESS")):
            opt = "/".join(a.value for a in c.args if isinstance(a, ast.Constant))
            out.append(f"{path.relative_to(ROOT)}:{c.lineno} {opt}")
    return out


def test_every_option_has_help():
    assert (ROOT / "fate_lab" / "cli.py").is_file() and len(FILES) > 2, "the file list is wrong"
    missing = [o for f in FILES for o in _offenders(f)]
    assert not missing, "options without help text:\n" + "\n".join(missing)
