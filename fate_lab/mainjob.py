"""The main job (``make main`` / ``python -m fate_lab main``): run every notebook, print their tables.

What it is: the one command that regenerates every figure and table of the suite from the
embedded model (or a local checkpoint), writing executed notebooks into ``out/notebooks`` and
ending with each notebook's paper-vs-ours table.
What it is not: a place for analysis; each notebook calls the package.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm


def final_text(path: Path) -> str:
    """The plain-text form of an executed notebook's closing paper-vs-ours table."""
    nb = json.loads(Path(path).read_text())
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    for o in code[-1].get("outputs", []) if code else []:
        text = o.get("data", {}).get("text/plain")
        if text:
            return "".join(text)
    return "(no table)"


def run_main(out: Path, model: str | None = None, fast: bool = False) -> None:
    """Execute every notebook into ``out/notebooks``, then print each one's paper-vs-ours table."""
    from fate_lab.study.notebooks import notebook_paths, run_notebook

    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    params = {"MODEL": model or "", "FAST": fast}
    nbs = notebook_paths()
    done = []
    for nb in tqdm(nbs, desc="notebooks", unit="nb"):
        done.append(run_notebook(nb, out / "notebooks", params))
    for path in done:
        print(f"\n== {path.stem}: paper vs ours\n{final_text(path)}")
    print(f"\n[fate_lab] {len(nbs)} notebooks executed into {out / 'notebooks'} in {time.time() - t0:.0f} s "
          f"(model: {model or 'the embedded tiny MoE'}; traces cached in results/cache)")
