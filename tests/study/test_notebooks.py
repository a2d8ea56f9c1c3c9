"""Every numbered notebook runs unattended in FAST mode on the embedded model, and is committed clean."""
import json
import os
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from helpers import embedded_models

from fate_lab.mainjob import final_claims
from fate_lab.study import lab, prose, verdict
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
    assert prose.unprinted_numbers(out) == [], f"{path.name}: numbers in markdown that no cell printed"
    assert prose.stderr_outputs(out) == [], f"{path.name}: a cell wrote to stderr"
    claims, meta = final_claims(out)
    assert meta["fast"] is True and {c.verdict for c in claims} <= set(verdict.VERDICTS)


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


def test_numbers_in_markdown_must_be_printed_and_nothing_goes_to_stderr(tmp_path):
    md = ("The paper reports **88.83%** (arXiv 2502.12224) over PCIe 3.0, `q=75` in code, 4.1x faster, "
          "layers 0..3, a 2.9 ratio.")
    assert prose.markdown_numbers(md) == ["88.83%", "4.1x", "2.9"]
    nb = {"cells": [{"cell_type": "markdown", "source": md},
                    {"cell_type": "code", "outputs": [
                        {"output_type": "stream", "name": "stdout", "text": "recall 88.83%; speed-up 4.1x"},
                        {"output_type": "stream", "name": "stderr", "text": "FutureWarning: old\nmore"}]}]}
    path = tmp_path / "p.ipynb"
    path.write_text(json.dumps(nb))
    assert prose.unprinted_numbers(path) == ["markdown cell 0: 2.9"]
    assert prose.stderr_outputs(path) == ["cell 1: FutureWarning: old"]


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
    from fate_lab.study import verdict

    html = lab.paper_table([verdict.close("recall", 0.7879, 0.812, 0.05, reference="78.79%")])._repr_html_()
    nb = {"cells": [{"cell_type": "code", "outputs": [{"output_type": "execute_result", "metadata": {},
                                                       "data": {"text/html": html, "text/plain": "..."}}]},
                    {"cell_type": "markdown", "source": "the end"}]}
    path = tmp_path / "t.ipynb"
    path.write_text(json.dumps(nb))
    assert table_numbers(final_table(path)) == ["78.79%", "81.2%", "within ±5 points of 78.79%"]
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
    from fate_lab.study import verdict

    claim = verdict.close("75th-percentile recall (decode)", 0.9715, 0.991, 0.05, reference="97.15%",
                          note="precision 25.0%, set size 8.0 of 32 (a fixed top quarter of the experts)")
    assert len(claim.why) > pd.get_option("display.max_colwidth")
    t = lab.paper_table([claim])
    assert isinstance(t, pd.DataFrame)
    assert claim.why in repr(t) and claim.why in t.to_string() and claim.why in t._repr_html_()
    assert "..." not in repr(t)
    assert pd.get_option("display.max_colwidth") == 50  # no global side effect
    assert "..." in repr(pd.DataFrame([[claim.why]]))  # other tables keep pandas' default


def test_paper_table_takes_only_claims():
    with pytest.raises(TypeError, match="verdict.Claim"):
        lab.paper_table([("recall", "78.79%", "70%", "close")])


# --- the main job's side-by-side tables, results page and README headline (hand examples)

def _claims(hit: float, cosine: float):
    from fate_lab.study import verdict

    return [verdict.close("hit rate", 0.99, hit, 0.05, reference="99%"),
            verdict.close("cosine", 0.88, cosine, 0.05, reference="88%")]


def test_side_by_side_puts_each_models_number_and_verdict_beside_the_papers():
    from fate_lab.mainjob import markdown, side_by_side

    rows = side_by_side({"m1": _claims(0.80, 0.90), "m2": _claims(0.70, 0.70)})
    assert [r["quantity"] for r in rows] == ["hit rate", "cosine"]
    assert (rows[0]["paper or target"], rows[0]["m1"], rows[0]["m2"]) == ("99%", "80.0%", "70.0%")
    assert rows[0]["models"] == "same verdict"  # both disagree, by other amounts
    assert (rows[1]["verdict (m1)"], rows[1]["verdict (m2)"], rows[1]["models"]) == ("agrees", "disagrees", "DIFFER")
    assert rows[1]["why (m2)"] == "18.0 points below 88%, outside ±5 points"
    only = side_by_side({"m1": _claims(0.8, 0.9), "m2": None})  # a notebook that showed no table
    assert only[0]["m2"] == "—" and only[0]["verdict (m2)"] == "—"
    assert markdown(rows, ["quantity", "m1"]).splitlines()[:2] == ["| quantity | m1 |", "|---|---|"]


def _executed(tmp_path, claims, fast=True, name="01_x.ipynb"):
    from IPython.core.formatters import DisplayFormatter

    data, _ = DisplayFormatter().format(lab.paper_table(claims, fast=fast))
    nb = {"cells": [{"cell_type": "code", "outputs": [{"output_type": "execute_result", "metadata": {},
                                                       "data": data}]}]}
    path = tmp_path / name
    path.write_text(json.dumps(nb, default=str))
    return path


def test_claims_travel_through_an_executed_notebook_unchanged(tmp_path):
    from fate_lab.mainjob import final_claims

    claims = _claims(0.8, 0.9)
    back, meta = final_claims(_executed(tmp_path, claims))
    assert back == claims and meta == {"fast": True}


def test_results_page_and_readme_headline_are_written_between_their_markers_from_one_verdict_data(tmp_path):
    from fate_lab.mainjob import (
        HEADLINE_BEGIN,
        HEADLINE_END,
        RESULTS_BEGIN,
        RESULTS_END,
        collect,
        headline,
        results_section,
        write_results,
    )

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    data = collect({"tiny_moe": {"01_x": _executed(tmp_path / "a", _claims(0.8, 0.9))},
                    "tiny_deepseek": {"01_x": _executed(tmp_path / "b", _claims(0.985, 0.7))}})
    section = results_section(data)
    assert "FAST mode" in section and "| hit rate | 99% | 80.0% — disagrees | 98.5% — agrees |" in section
    assert "- *cosine*, `tiny_deepseek`: disagrees: 18.0 points below 88%, outside ±5 points" in section
    assert "In all: 2 agrees, 2 disagrees." in section
    short = headline(data)  # by hand: hit rate disagrees / agrees, cosine agrees / disagrees
    assert "on `tiny_moe` and `tiny_deepseek`: **2 agrees, 2 disagrees**" in short and "(docs/results.md)" in short
    assert "| 01_x | 2 | 2 | 0 |" in short.splitlines()
    results, readme = tmp_path / "results.md", tmp_path / "README.md"
    results.write_text(f"# r\n\nbefore\n{RESULTS_BEGIN}\nold rows\n{RESULTS_END}\nafter\n")
    readme.write_text(f"# t\n{HEADLINE_BEGIN}\nold counts\n{HEADLINE_END}\nafter\n")
    write_results(data, results, readme)
    page, front = results.read_text(), readme.read_text()
    assert page == f"# r\n\nbefore\n{RESULTS_BEGIN}\n{section}{RESULTS_END}\nafter\n"
    assert front == f"# t\n{HEADLINE_BEGIN}\n{short}{HEADLINE_END}\nafter\n"
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="README.md has not one pair of markers"):
        write_results(data, None, readme)
    assert readme.read_text() == "no markers"


def test_the_committed_pages_have_the_results_markers():
    from fate_lab.mainjob import HEADLINE_BEGIN, HEADLINE_END, README, RESULTS, RESULTS_BEGIN, RESULTS_END

    for path, begin, end in ((RESULTS, RESULTS_BEGIN, RESULTS_END), (README, HEADLINE_BEGIN, HEADLINE_END)):
        text = path.read_text()
        assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end), path


def test_verdict_changes_between_two_runs(tmp_path):
    from fate_lab.mainjob import collect, verdict_changes

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fast = collect({"m": {"01_x": _executed(tmp_path / "a", _claims(0.8, 0.9))}})
    full = collect({"m": {"01_x": _executed(tmp_path / "b", _claims(0.8, 0.7), fast=False)}})
    assert verdict_changes(fast, full) == ["01_x / m: cosine: agrees -> disagrees"]


def test_paper_table_carries_its_claims_as_data_beside_the_html():
    from IPython.core.formatters import DisplayFormatter

    from fate_lab.study import verdict

    claim = verdict.holds("q", True, "yes")
    data, _ = DisplayFormatter().format(lab.paper_table([claim], fast=True))
    assert "<table" in data["text/html"] and "agrees" in data["text/plain"]
    table = data[lab.TABLE_MIME]
    assert table["columns"] == lab.PAPER_COLUMNS and table["rows"] == [["q", "must hold", "yes", "agrees", "holds"]]
    assert table["claims"] == [claim.as_dict()] and table["meta"] == {"fast": True}


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


def test_the_main_job_gives_the_kernels_an_absolute_run_folder(tmp_path, monkeypatch):
    # the kernels run in notebooks/, so a relative --out must not reach them as a relative path (it did: the clock
    # of one run went to notebooks/results/.run, where the next run's "calibrate anew" never deleted it)
    import fate_lab.study.notebooks as nbmod
    from fate_lab.mainjob import run_main
    from fate_lab.study.clock import RUN_DIR_ENV

    seen = []

    class Stop(Exception):
        pass

    def fake(path, out_dir, parameters, timeout=None):
        seen.append(os.environ[RUN_DIR_ENV])
        raise Stop

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(nbmod, "run_notebook", fake)
    with pytest.raises(Stop):
        run_main(Path("results"), models=["tiny_moe"], results=None, readme=None)
    assert seen == [str((tmp_path / "results" / ".run").resolve())]
