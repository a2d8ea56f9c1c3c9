"""Every numbered notebook runs unattended in FAST mode on the embedded model, and is committed clean."""
import pytest

from fate_lab.notebooks import dirty_notebooks, notebook_paths, run_notebook

NOTEBOOKS = notebook_paths()


def test_there_are_numbered_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == [f"{i:02d}" for i in range(len(NOTEBOOKS))]


def test_committed_notebooks_are_clean():
    assert dirty_notebooks() == []


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_fast_mode(path, tmp_path):
    out = run_notebook(path, tmp_path, {"MODEL": "", "FAST": True}, timeout=600)
    assert out.exists()
