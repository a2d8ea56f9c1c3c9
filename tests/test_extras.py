"""The runtime, the simulator, the replay and `plan` work without the notebook stack (a plain
`pip install fate_lab`, no extras): each runs in a subprocess where importing matplotlib, seaborn, ipywidgets,
scikit-learn, jupyter or IPython raises ImportError, and its result is checked against the same call made here
with everything installed. A figure asked for there fails with one line naming the extra to install."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# "Not installed" as both `import x` and `importlib.util.find_spec("x")` see it: a None entry in sys.modules makes
# the import raise ModuleNotFoundError and find_spec answer None (transformers probes optional packages with
# find_spec; a meta-path finder that raises would break that probe, which a real absence never does).
BLOCKER = '''
import sys
BLOCKED = ("matplotlib", "seaborn", "ipywidgets", "sklearn", "jupyter", "jupyter_client", "jupyter_core",
           "jupyterlab", "IPython", "ipykernel", "papermill", "nbformat", "nbclient")
sys.modules.update(dict.fromkeys(BLOCKED))
'''

RUN = '''
import json, sys, torch
import fate_lab
model, tok = fate_lab.load_model()
ids = tok("The word", return_tensors="pt")
with fate_lab.offload(model, fate_lab.OffloadConfig.preset("fate", slots=8, link="instant")) as rt:
    out = model.generate(**ids, max_new_tokens=6, do_sample=False)
with fate_lab.offload(model, fate_lab.OffloadConfig.preset("fate_learned", slots=8, link="instant")) as rt:
    learned = model.generate(**ids, max_new_tokens=6, do_sample=False)  # the shipped probes, no scikit-learn
trace = fate_lab.record_trace(model, tok, ["Once upon a time", "The river"], decode_tokens=6)
trace.save(sys.argv[1])
shape = fate_lab.ModelShape.from_adapter(fate_lab.adapt(model))
cfg = fate_lab.OffloadConfig.preset("lru", slots=8)
sim = fate_lab.simulate(trace, cfg, fate_lab.Hardware.scaled("qwen15_moe_rtx3090_pcie3"), shape)
rep = fate_lab.replay(trace, cfg).total("decode")
print(json.dumps({"tokens": out[0].tolist(), "learned": learned[0].tolist(),
                  "sim_tok_s": sim.decode_tok_s, "hits": rep.hits, "misses": rep.misses}))
assert all(sys.modules[name] is None for name in BLOCKED)
'''


def _blocked(code: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", BLOCKER + code, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)


def test_the_blocker_blocks():
    r = _blocked("import matplotlib")
    assert r.returncode != 0 and "import of matplotlib halted" in r.stderr


def test_offload_simulate_replay_without_the_notebook_stack(tmp_path):
    import fate_lab

    r = _blocked(RUN, str(tmp_path / "t.safetensors"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    model, tok = fate_lab.load_model()
    plain = model.generate(**tok("The word", return_tensors="pt"), max_new_tokens=6, do_sample=False)
    assert got["tokens"] == got["learned"] == plain[0].tolist()  # the offloaded runs' tokens are the plain model's
    trace = fate_lab.Trace.load(tmp_path / "t.safetensors")
    rep = fate_lab.replay(trace, fate_lab.OffloadConfig.preset("lru", slots=8)).total("decode")
    assert (got["hits"], got["misses"]) == (rep.hits, rep.misses) and rep.hits + rep.misses > 0
    assert got["sim_tok_s"] > 0


def test_plan_cli_without_the_notebook_stack(capsys):
    from fate_lab.cli import main

    argv = ["plan", "--model", "tiny_moe", "--device", "rtx3090", "--budget", "0.05GiB", "--presets",
            "lru,all_resident", "--json"]
    r = _blocked("import runpy, sys; sys.argv = ['fate_lab', *sys.argv[1:]]; "
                 "runpy.run_module('fate_lab', run_name='__main__')", *argv)
    assert r.returncode == 0, r.stderr[-3000:]
    main(argv)
    assert json.loads(r.stdout) == json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("call,extra", [
    ("from fate_lab.study import plots", "plots"),
    ("from fate_lab.study.widgets import layout; layout.slider('int', 'x')", "notebooks"),
    ("from fate_lab.extras import need; need('sklearn.cluster')", "learned"),
])
def test_a_figure_or_widget_names_its_extra(call, extra):
    r = _blocked(call)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert f"fate_lab[{extra}]" in last, r.stderr[-2000:]
