"""Every numbered notebook runs unattended in FAST mode on the embedded model, and is committed clean."""
import json

import nbformat
import pandas as pd
import pytest
from helpers import embedded_models

from fate_lab.study import lab
from fate_lab.study.notebooks import (
    FAST_CELL_TIMEOUT,
    FULL_CELL_TIMEOUT,
    NotebookCellTimeout,
    cell_timeout,
    dirty_notebooks,
    final_table,
    notebook_errors,
    notebook_paths,
    run_notebook,
    table_numbers,
)

NOTEBOOKS = notebook_paths()


def test_there_are_numbered_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == [f"{i:02d}" for i in range(len(NOTEBOOKS))]


def test_committed_notebooks_are_clean():
    assert dirty_notebooks() == []


@pytest.mark.notebook
@pytest.mark.parametrize("model_name", embedded_models())
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_fast_mode(path, model_name, tmp_path):
    out = run_notebook(path, tmp_path, {"MODEL": model_name, "FAST": True})  # papermill raises if a cell raises
    assert notebook_errors(out) == []  # also tracebacks shown inside Output widgets
    table = final_table(out)
    assert "<table" in table, f"{path.name}: the last cell shows no table"
    assert table_numbers(table), f"{path.name}: the paper-vs-ours table holds no number:\n{table[:2000]}"


# --- the runner's pieces, on small hand-made notebooks (a kernel start each: a second or two)

def _notebook(tmp_path, *sources, name="t.ipynb"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell("# a test notebook"),
                nbformat.v4.new_code_cell("FAST = False", metadata={"tags": ["parameters"]})]
    nb.cells += [nbformat.v4.new_code_cell(s) for s in sources]
    path = tmp_path / name
    nbformat.write(nb, str(path))
    return path


@pytest.mark.slow
def test_a_stalled_cell_fails_fast_naming_notebook_and_cell(tmp_path):
    path = _notebook(tmp_path, "x = 1", "import time\ntime.sleep(60)", "x + 1", name="stall.ipynb")
    with pytest.raises(NotebookCellTimeout, match=r"stall\.ipynb: cell 3 .*'import time'.* within 2 s"):
        run_notebook(path, tmp_path / "out", {"FAST": True}, timeout=2)


@pytest.mark.slow
def test_the_kernel_runs_over_ipc_without_the_tcp_warning(tmp_path, capfd):
    path = _notebook(tmp_path, "from ipykernel.kernelapp import IPKernelApp\nIPKernelApp.instance().transport")
    out = run_notebook(path, tmp_path / "out", {"FAST": True})
    nb = json.loads(out.read_text())
    assert "".join(nb["cells"][-1]["outputs"][0]["data"]["text/plain"]) == "'ipc'"
    assert "without encryption" not in capfd.readouterr().err


@pytest.mark.slow
def test_cells_drawing_into_an_output_widget_do_not_wait_out_the_cell_limit(tmp_path):
    # nbclient answers each output shown inside an Output widget (as every explorer draws) with a comm
    # message on the shell socket while it awaits the cell's reply there. Without the runner's
    # kernelclient.RunnerKernelClient such a send could swallow the wake-up of a reply that had just
    # arrived, and the cell then took exactly the per-cell limit (this notebook: a stalled cell in 11 of 11 runs).
    show = ("out.clear_output()\nwith out:\n    for i in range(20):\n"
            "        display({'text/plain': str(i) * 5000}, raw=True)")
    path = _notebook(tmp_path, "import ipywidgets as W\nfrom IPython.display import display\nout = W.Output()\nout",
                     *[show] * 12, name="widgets.ipynb")
    limit = 10
    out = run_notebook(path, tmp_path / "out", {"FAST": True}, timeout=limit)
    nb = json.loads(out.read_text())
    took = [round(c["metadata"]["papermill"]["duration"], 1) for c in nb["cells"] if c["cell_type"] == "code"]
    assert max(took) < limit / 2, f"a cell waited for its reply until the {limit} s limit: {took}"
    assert notebook_errors(out) == []


def test_error_outputs_are_found_in_cells_and_output_widgets(tmp_path):
    err = {"output_type": "error", "ename": "TraitError", "evalue": "Setting min > max", "traceback": []}
    nb = {"cells": [{"cell_type": "code", "outputs": [], "metadata": {"tags": ["injected-parameters"]}},
                    {"cell_type": "code", "outputs": [err], "metadata": {}}],
          "metadata": {"widgets": {"application/vnd.jupyter.widget-state+json": {
              "state": {"abcdef0123": {"model_name": "OutputModel", "state": {"outputs": [err]}}}}}}}
    path = tmp_path / "e.ipynb"
    path.write_text(json.dumps(nb))
    assert notebook_errors(path) == ["e.ipynb cell 0: TraitError: Setting min > max",
                                     "e.ipynb output widget abcdef01: TraitError: Setting min > max"]


def test_final_table_and_its_numbers(tmp_path):
    html = lab.paper_table([("recall", "78.79%", "81.20%", "close")])._repr_html_()
    nb = {"cells": [{"cell_type": "code", "outputs": [{"output_type": "execute_result", "metadata": {},
                                                       "data": {"text/html": html, "text/plain": "..."}}]},
                    {"cell_type": "markdown", "source": "the end"}]}
    path = tmp_path / "t.ipynb"
    path.write_text(json.dumps(nb))
    assert table_numbers(final_table(path)) == ["78.79%", "81.20%"]
    assert table_numbers("   quantity  ours\n0  recall  n/a") == []  # the row index is not a number


def test_cell_timeout_defaults_by_mode_and_env(monkeypatch):
    monkeypatch.delenv("FATE_LAB_FAST", raising=False)
    monkeypatch.delenv("FATE_LAB_CELL_TIMEOUT", raising=False)
    assert cell_timeout({"FAST": True}) == FAST_CELL_TIMEOUT == 300
    assert cell_timeout({"FAST": False}) == FULL_CELL_TIMEOUT > FAST_CELL_TIMEOUT
    assert cell_timeout({"FAST": False}, timeout=7) == 7
    monkeypatch.setenv("FATE_LAB_FAST", "1")
    assert cell_timeout({"FAST": False}) == FAST_CELL_TIMEOUT
    monkeypatch.setenv("FATE_LAB_CELL_TIMEOUT", "45")
    assert cell_timeout({"FAST": False}) == 45
    monkeypatch.setenv("FATE_LAB_CELL_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="whole number of seconds"):
        cell_timeout({})


# --- lab helpers the notebooks call

@pytest.mark.parametrize("env, param, expected", [
    (None, False, False), (None, True, True), ("1", False, True), ("true", False, True),
    ("0", False, False), ("0", True, True), ("", True, True),
])
def test_fast_mode_env_can_only_switch_fast_on(monkeypatch, env, param, expected):
    if env is None:
        monkeypatch.delenv("FATE_LAB_FAST", raising=False)
    else:
        monkeypatch.setenv("FATE_LAB_FAST", env)
    assert lab.fast_mode(param) is expected


def test_fast_mode_refuses_an_unclear_value(monkeypatch):
    monkeypatch.setenv("FATE_LAB_FAST", "maybe")
    with pytest.raises(ValueError, match="FATE_LAB_FAST"):
        lab.fast_mode(False)


def test_paper_table_shows_full_sentences_in_text_and_html():
    sentence = "precision 25.00%, set size 8.0 of 32 (a fixed top quarter of the experts)"
    assert len(sentence) > pd.get_option("display.max_colwidth")
    t = lab.paper_table([("75th-percentile recall (decode)", "97.15%", "99.10%", sentence)])
    assert isinstance(t, pd.DataFrame)
    assert sentence in repr(t) and sentence in t.to_string() and sentence in t._repr_html_()
    assert "..." not in repr(t)
    assert pd.get_option("display.max_colwidth") == 50  # no global side effect
    assert "..." in repr(pd.DataFrame([[sentence]]))  # other tables keep pandas' default


# --- the main job's side-by-side tables (hand examples)

def test_side_by_side_puts_each_models_number_beside_the_papers():
    from fate_lab.mainjob import markdown, side_by_side

    a = [["hit rate", "99%", "80.00%", "lower than the paper's"], ["cosine", "88%", "90.00%", "agrees within 5 points"]]
    b = [["hit rate", "99%", "70.00%", "lower than the paper's"], ["cosine", "88%", "70.00%", "lower than the paper's"]]
    rows = side_by_side({"m1": a, "m2": b})
    assert [r["quantity"] for r in rows] == ["hit rate", "cosine"]
    assert (rows[0]["paper"], rows[0]["m1"], rows[0]["m2"]) == ("99%", "80.00%", "70.00%")
    assert rows[0]["models"] == "same verdict"  # same words, other numbers
    assert rows[1]["models"].startswith("DIFFER")
    assert rows[1]["agreement (m2)"] == "lower than the paper's"
    only = side_by_side({"m1": a, "m2": None})  # a notebook that showed no table
    assert only[0]["m2"] == "—"
    assert markdown(rows).splitlines()[0] == ("| quantity | paper | m1 | m2 | agreement (m1) | agreement (m2) | "
                                              "models |")


def test_paper_table_carries_its_rows_as_data_beside_the_html():
    from IPython.core.formatters import DisplayFormatter

    table = lab.paper_table([("q", "1%", "2%", "close")])
    data, _ = DisplayFormatter().format(table)
    assert "<table" in data["text/html"] and "close" in data["text/plain"]
    assert data[lab.TABLE_MIME] == {"columns": ["quantity", "paper (Qwen1.5-MoE)", "ours", "agreement"],
                                   "rows": [["q", "1%", "2%", "close"]]}


def test_tables_only_refuses_a_folder_without_executed_notebooks(tmp_path):
    from fate_lab.mainjob import run_main

    with pytest.raises(FileNotFoundError, match="no executed notebook .*run `python -m fate_lab main` first"):
        run_main(tmp_path, models=["tiny_moe"], tables_only=True)


def test_presets_whose_files_a_model_lacks_are_left_out_by_name(tmp_path, capsys):
    # a folder with neither probes.safetensors nor expert_similarity.safetensors
    kept = lab.presets_for(str(tmp_path), ["fate", "fate_learned", "substitute", "lru"])
    assert kept == ["fate", "lru"]
    said = capsys.readouterr().out
    assert "fate_learned (no probes.safetensors" in said and "substitute (no expert_similarity.safetensors" in said
    assert lab.presets_for("tiny_deepseek", ["fate_learned", "substitute"]) == ["fate_learned", "substitute"]
