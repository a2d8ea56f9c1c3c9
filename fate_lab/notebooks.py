"""Running and checking the numbered notebooks (papermill, nbformat).

What it is: the functions behind ``make main`` (execute every notebook with parameters) and
the clean-notebook check. What it is not: notebook content; that lives in ``notebooks/``.
"""
from __future__ import annotations

import json
from pathlib import Path

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"


def notebook_paths(folder: Path = NOTEBOOK_DIR) -> list[Path]:
    """The numbered notebooks (``NN_name.ipynb``) in order."""
    return sorted(p for p in Path(folder).glob("[0-9][0-9]_*.ipynb"))


def dirty_notebooks(folder: Path = NOTEBOOK_DIR) -> list[str]:
    """One line per notebook that keeps outputs, execution counts or widget state."""
    lines = []
    for p in notebook_paths(folder):
        nb = json.loads(p.read_text())
        cells = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
        n_out = sum(1 for c in cells if c.get("outputs"))
        n_exec = sum(1 for c in cells if c.get("execution_count") is not None)
        if n_out or n_exec or nb.get("metadata", {}).get("widgets"):
            lines.append(f"{p}: {n_out} cells with outputs, {n_exec} with execution counts"
                         + (", widget state" if nb.get("metadata", {}).get("widgets") else ""))
    return lines


def run_notebook(path: Path, out_dir: Path, parameters: dict, timeout: int = 1200) -> Path:
    """Execute one notebook with papermill into ``out_dir`` (the committed notebook stays clean)."""
    import papermill as pm

    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / path.name
    pm.execute_notebook(str(path), str(out), parameters=parameters, cwd=str(path.parent),
                        kernel_name="python3", progress_bar=False, execution_timeout=timeout)
    return out
