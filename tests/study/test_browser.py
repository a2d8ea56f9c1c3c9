"""The widgets in a real browser: JupyterLab started here, headless Chromium (Debian's package, driven
by playwright's Python API; never a downloaded browser build), notebooks run in FAST mode, controls moved,
and the output checked to change to the right thing. Skipped, saying why, without Chromium or playwright;
`.ci/run` installs Chromium so CI runs it.
"""
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fate_lab.study.notebooks import NOTEBOOK_DIR

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.notebook,
              pytest.mark.skipif(CHROMIUM is None, reason="no Chromium: apt-get install chromium to run the browser test")]
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")

RUN_S = 240  # longest wait for one notebook's cells in FAST mode (a loaded 2-core machine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab_url(tmp_path_factory):
    """A JupyterLab server on a copy of the notebooks, FAST mode forced through the environment."""
    root = tmp_path_factory.mktemp("lab")
    for nb in ("03_prefetch_accuracy.ipynb", "04_shallow_favoring_cache.ipynb"):
        shutil.copy(NOTEBOOK_DIR / nb, root / nb)
    port = _free_port()
    env = dict(os.environ, FATE_LAB_FAST="1")
    log = open(root / "lab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
                             "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=", "--ServerApp.password=", "--allow-root",
                             f"--ServerApp.root_dir={root}", "--ServerApp.disable_check_xsrf=True",
                             "--LabApp.news_url=None", f"--LabApp.workspaces_dir={root / 'workspaces'}", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"JupyterLab did not start; see {root / 'lab.log'}")
            time.sleep(0.5)
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def _open_and_run(browser, url: str, name: str):
    """Open a notebook in JupyterLab, Run All Cells, and wait until every cell has run."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(f"{url}/lab/tree/{name}?reset")  # a fresh workspace: no other notebook restored beside it
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60_000)
    # the kernel must be connected and idle before Run All (else only the first cell runs)
    page.wait_for_function("() => /\\|\\s*Idle/.test(document.querySelector('.jp-StatusBar-Widget')?.parentElement"
                           "?.textContent ?? '')", timeout=90_000)
    time.sleep(2)
    page.click(".lm-MenuBar-itemLabel:text-is('Run')")
    page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")
    # every code cell shows an execution count when done; the kernel then goes idle
    try:
        page.wait_for_function(
            "() => { const p = [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')];"
            " return p.length > 0 && p.every(e => /\\[\\d+\\]/.test(e.textContent)); }", timeout=RUN_S * 1000)
    except Exception:
        prompts = page.evaluate("() => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')]"
                                ".map(e => e.textContent)")
        page.screenshot(path=str(Path(os.environ.get("TMPDIR", "/tmp")) / f"browser-{name}.png"))
        raise AssertionError(f"{name}: cells not all run after {RUN_S} s; prompts {prompts}")
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] :text('Traceback')")
    assert errors.count() == 0, f"{name}: a cell raised"
    return page


def _widget_output(page, marker: str) -> str:
    """Text of the widget output area (ipywidgets Output) that contains marker."""
    page.wait_for_function("(m) => [...document.querySelectorAll('.widget-output')]"
                           ".some(e => e.textContent.includes(m))", arg=marker, timeout=60_000)
    return page.locator(".widget-output", has_text=marker).last.text_content()


def test_prefetch_explorer_switches_rules_in_the_browser(lab_url, browser):
    page = _open_and_run(browser, lab_url, "03_prefetch_accuracy.ipynb")
    before = _widget_output(page, "Percentile(")
    assert "Percentile(q=75.0)" in before
    select = page.locator(".widget-dropdown select").first
    select.scroll_into_view_if_needed()
    select.select_option(label="count budget")
    page.wait_for_function("() => [...document.querySelectorAll('.widget-output')]"
                           ".some(e => e.textContent.includes('CountBudget('))", timeout=60_000)
    after = _widget_output(page, "CountBudget(")
    n = int(re.search(r"CountBudget\(n=(\d+)\)", after).group(1))
    assert n > 0  # the first version drew CountBudget(n=0)
    # the slider that is shown is the count's integer slider, with the model's 32 experts as its maximum
    assert page.locator(".widget-slider:visible").count() == 1
    select.select_option(label="percentile (paper: q=75)")
    page.wait_for_function("() => [...document.querySelectorAll('.widget-output')]"
                           ".some(e => e.textContent.includes('Percentile(q=75'))", timeout=60_000)
    page.close()


def test_cache_explorer_moves_the_boundary_in_the_browser(lab_url, browser):
    page = _open_and_run(browser, lab_url, "04_shallow_favoring_cache.ipynb")
    out = _widget_output(page, "slots per layer")
    slider = page.locator(".widget-slider", has_text="L (shallow)").first
    slider.scroll_into_view_if_needed()
    readout = slider.locator(".widget-readout")
    assert readout.inner_text().strip() == "3"
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type("1")
    page.keyboard.press("Enter")
    page.wait_for_function("(before) => { const o = [...document.querySelectorAll('.widget-output')]"
                           ".filter(e => e.textContent.includes('slots per layer')); return o.length && o[o.length - 1]"
                           ".textContent !== before; }", arg=out, timeout=120_000)
    new = _widget_output(page, "slots per layer")
    assert new != out and readout.inner_text().strip() == "1"
    page.close()
