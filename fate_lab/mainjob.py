"""The main job (``make main`` / ``python -m fate_lab main``): trace the model, run every notebook.

What it is: the one command that regenerates every figure and table of the suite from the
embedded model (or a local checkpoint), writing executed notebooks and a trace into ``out``.
What it is not: a place for analysis; each notebook calls the package.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm


def run_main(out: Path, model: str | None = None, fast: bool = False) -> None:
    """Record a trace on held-out prompts, print its summary, then execute every notebook."""
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.models import load_model
    from fate_lab.study.notebooks import notebook_paths, run_notebook
    from fate_lab.model.trace import record_trace

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    m, tok = load_model(model)
    n_prompts, n_decode = (2, 8) if fast else (8, 64)
    trace = record_trace(m, tok, heldout_prompts(n_prompts), decode_tokens=n_decode)
    path = trace.save(out / "trace.safetensors")
    print(f"[fate_lab] trace of {model or 'the embedded tiny MoE'} -> {path}")
    print(json.dumps(trace.summary(), indent=1))
    for p, text in enumerate(trace.meta["generated"][:2]):
        print(f"[fate_lab] prompt {p} greedy continuation: {text[:160]!r}")
    params = {"MODEL": model or "", "FAST": fast}
    nbs = notebook_paths()
    for nb in tqdm(nbs, desc="notebooks", unit="nb"):
        run_notebook(nb, out / "notebooks", params)
    print(f"[fate_lab] {len(nbs)} notebooks executed into {out / 'notebooks'} in {time.time() - t0:.0f} s")
