"""The bad-input probes of scripts/probe_inputs.py as a test: every probe a clear error, none accepted silently,
every valid input run; the cases that wait on other work are counted apart (pending), each naming what it waits on."""
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_bad_input_probe_gets_a_clear_error(capsys):
    spec = importlib.util.spec_from_file_location("probe_inputs", ROOT / "scripts" / "probe_inputs.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    rc = probe.main()
    out = capsys.readouterr().out
    assert rc == 0, "\n".join(line for line in out.splitlines() if line.startswith(("unclear", "silent")))
    assert "unclear error: 0, silent accept: 0" in out
    total = int(re.search(r"\(of (\d+) probes\)", out).group(1))
    assert total >= 150
    for surface in ("load_offloaded:", "load_model:", "trace:", "routing array:", "quantize:", "policy=", "auto",
                    "plan CLI:", "sweep:"):
        assert surface in out, surface
    pending = re.findall(r"^pending on (.+?): (\d+)", out, flags=re.M)
    assert all(len(owner) > 10 for owner, _ in pending), pending  # each names what it waits on
