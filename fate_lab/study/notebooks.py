"""Running and checking the numbered notebooks (papermill, nbformat).

What it is: the functions behind ``make main`` (execute every notebook with parameters), the
clean-notebook check, and the checks of an executed notebook (no error output, a closing table
that holds numbers). What it is not: notebook content; that lives in ``notebooks/``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"

# Per-cell execution timeouts (seconds). A cell that stalls fails after this long, with a message
# naming the notebook and the cell, instead of hanging a test run for 20 minutes. FAST cells
# (the tests) take seconds; full-size cells (``make main``) record longer traces.
FAST_CELL_TIMEOUT = 300
FULL_CELL_TIMEOUT = 1200
CELL_TIMEOUT_ENV = "FATE_LAB_CELL_TIMEOUT"  # overrides both defaults, e.g. on a slow machine


class NotebookCellTimeout(TimeoutError):
    """A notebook cell ran past its per-cell timeout (the message names the notebook and the cell)."""


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


def cell_timeout(parameters: dict, timeout: int | None = None) -> int:
    """Seconds a cell may run: ``timeout`` if given, else ``$FATE_LAB_CELL_TIMEOUT``, else the
    FAST or full-size default (FAST as the notebook will see it, ``FATE_LAB_FAST`` included)."""
    from fate_lab.study.lab import fast_mode

    if timeout is None and os.environ.get(CELL_TIMEOUT_ENV, "").strip():
        raw = os.environ[CELL_TIMEOUT_ENV]
        if not raw.strip().isdigit():
            raise ValueError(f"{CELL_TIMEOUT_ENV}={raw!r}: give a whole number of seconds")
        timeout = int(raw)
    if timeout is None:
        timeout = FAST_CELL_TIMEOUT if fast_mode(bool(parameters.get("FAST", False))) else FULL_CELL_TIMEOUT
    if timeout <= 0:
        raise ValueError(f"the per-cell timeout must be positive, got {timeout}")
    return timeout


def _ipc_kernel_config(socket_dir: Path):
    """Kernel-manager config for a local kernel over IPC (Unix sockets in ``socket_dir``), talked to
    through ``kernelclient.RunnerKernelClient``.

    Over TCP (Jupyter's default) ipykernel warns on every run that its traffic is unencrypted;
    the kernel is local, so Unix sockets in a private folder avoid both the warning and the open
    ports. The socket path is absolute: papermill runs the kernel in the notebook's folder.
    The client is jupyter_client's asyncio one with a shell channel whose sends cannot swallow the
    wake-up of a reply that has just arrived; without it a widget cell (an explorer drawing into an
    Output widget) intermittently waited out the whole per-cell limit for a reply the kernel had
    already sent (see ``kernelclient``).
    """
    from traitlets.config import Config

    cfg = Config()
    cfg.KernelManager.transport = "ipc"
    cfg.KernelManager.ip = str(socket_dir / "kernel")
    cfg.AsyncKernelManager.client_class = "fate_lab.study.kernelclient.RunnerKernelClient"
    return cfg


# Cells papermill adds to its output: the injected parameters, and red banners above a failed cell.
_PAPERMILL_TAGS = {"injected-parameters", "papermill-error-cell-tag"}


def _source_index(cells: list, index: int) -> int:
    """A cell's index in the source notebook, from its index in papermill's output ``cells``."""
    added = sum(1 for c in cells[:index] if _PAPERMILL_TAGS & set(c.get("metadata", {}).get("tags", [])))
    return index - added


def _timeout_message(path: Path, out: Path, timeout: int) -> str:
    """Which cell of ``path`` ran past ``timeout``: the last one papermill started, in ``out``."""
    import nbformat

    where = "a cell"
    try:
        nb = nbformat.read(str(out), as_version=4)
        started = [i for i, c in enumerate(nb.cells) if c.get("metadata", {}).get("papermill", {}).get("start_time")]
        if started:
            i = started[-1]
            first = next((ln for ln in nb.cells[i].source.splitlines() if ln.strip()), "")
            where = f"cell {_source_index(nb.cells, i)} (0-based, markdown included; first line: {first[:80]!r})"
    except Exception:  # the partial output is a convenience; the timeout itself is the error
        pass
    return (f"{path.name}: {where} did not finish within {timeout} s. Raise the per-cell limit with "
            f"run_notebook(timeout=...) or {CELL_TIMEOUT_ENV}=<seconds> if the cell is merely slow; "
            f"the partial output is in {out}")


def run_notebook(path: Path, out_dir: Path, parameters: dict, timeout: int | None = None) -> Path:
    """Execute one notebook with papermill into ``out_dir`` (the committed notebook stays clean).

    ``timeout`` is per cell (default: ``cell_timeout``, 300 s FAST, 1200 s full size); a cell that
    runs past it raises ``NotebookCellTimeout`` naming the notebook and the cell. A cell that
    raises makes papermill raise ``PapermillExecutionError``. The kernel talks over IPC.
    """
    import papermill as pm
    from nbclient.exceptions import CellTimeoutError

    limit = cell_timeout(parameters, timeout)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / path.name
    socket_dir = Path(tempfile.mkdtemp(prefix="fate_lab-kernel-"))
    try:
        pm.execute_notebook(str(path), str(out), parameters=parameters, cwd=str(path.parent),
                            kernel_name="python3", progress_bar=False, execution_timeout=limit,
                            config=_ipc_kernel_config(socket_dir))
    except CellTimeoutError as e:  # nbclient's message names neither the notebook nor the cell
        raise NotebookCellTimeout(_timeout_message(path, out, limit)) from e
    except Exception as e:
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(f"while running {path} (partial output: {out})")
        raise
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
    return out


def _outputs_of(nb) -> list[tuple[str, dict]]:
    """(where, output) for every output of an executed notebook: code cells, then Output widgets."""
    found = []
    cells = nb.get("cells", [])
    for i, c in enumerate(cells):
        for o in c.get("outputs", []) or []:
            found.append((f"cell {_source_index(cells, i)}", o))
    state = nb.get("metadata", {}).get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    for model_id, model in (state.get("state") or {}).items():
        for o in (model.get("state") or {}).get("outputs", []) or []:
            found.append((f"output widget {model_id[:8]}", o))
    return found


def notebook_errors(path: Path) -> list[str]:
    """One line per error output of an executed notebook, in cells or in Output widgets
    (where a widget callback's traceback lands; papermill only looks at cells)."""
    nb = json.loads(Path(path).read_text())
    return [f"{Path(path).name} {where}: {o.get('ename')}: {o.get('evalue')}"
            for where, o in _outputs_of(nb) if o.get("output_type") == "error"]


def _text(data) -> str:
    """A notebook output field (a string, or the list of lines nbformat stores) as one string."""
    return "".join(data) if isinstance(data, list) else str(data or "")


def final_table(path: Path) -> str:
    """The table the last code cell of an executed notebook displays (HTML if any, else plain text)."""
    nb = json.loads(Path(path).read_text())
    code = [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    if not code:
        raise ValueError(f"{Path(path).name} has no code cell")
    shown = [o.get("data", {}) for o in code[-1].get("outputs", [])
             if o.get("output_type") in ("execute_result", "display_data")]
    for data in shown:
        if "<table" in _text(data.get("text/html")):
            return _text(data["text/html"])
    return "\n".join(_text(d.get("text/plain")) for d in shown)


def table_numbers(table: str) -> list[str]:
    """The cells of a rendered table (HTML ``<td>``, else plain-text rows) that hold a digit."""
    if "<table" in table:
        cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", table, flags=re.S)]
    else:
        rows = table.splitlines()[1:]  # the header row names the columns
        cells = [r.split(None, 1)[1] if len(r.split(None, 1)) == 2 else "" for r in rows]  # less the index
    return [c.strip() for c in cells if re.search(r"\d", c)]
