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
              pytest.mark.skipif(CHROMIUM is None,
                                 reason="no Chromium: apt-get install chromium to run the browser test")]
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")

RUN_S = 600  # longest wait for one notebook's cells in FAST mode (05 times every preset; a loaded 2-core machine)
NOTEBOOKS = ("03_prefetch_accuracy.ipynb", "04_shallow_favoring_cache.ipynb", "05_end_to_end_decode.ipynb",
             "07_beyond_fate.ipynb", "08_quality_for_speed.ipynb", "09_size_your_deployment.ipynb")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab_url(tmp_path_factory):
    """A JupyterLab server on a copy of the notebooks, FAST mode forced through the environment."""
    root = tmp_path_factory.mktemp("lab")
    for nb in NOTEBOOKS:
        shutil.copy(NOTEBOOK_DIR / nb, root / nb)
    # every cell rendered in full: JupyterLab's default windowing skips off-screen cells' content, which hides
    # an explorer from the locators once Run All has scrolled past it
    settings = root / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    port = _free_port()
    env = dict(os.environ, FATE_LAB_FAST="1")
    log = open(root / "lab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
                             "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=", "--ServerApp.password=",
                             "--allow-root",
                             f"--ServerApp.root_dir={root}", "--ServerApp.disable_check_xsrf=True",
                             "--LabApp.news_url=None", f"--LabApp.workspaces_dir={root / 'workspaces'}",
                             f"--LabApp.user_settings_dir={root / 'settings'}",
                             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
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
                raise RuntimeError(f"JupyterLab did not start; see {root / 'lab.log'}") from None
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
            "() => { const p = [...document.querySelectorAll("
            "'.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')];"
            " return p.length > 0 && p.every(e => /\\[\\d+\\]/.test(e.textContent)); }", timeout=RUN_S * 1000)
    except Exception as exc:
        prompts = page.evaluate("() => [...document.querySelectorAll("
                                "'.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')]"
                                ".map(e => e.textContent)")
        page.screenshot(path=str(Path(os.environ.get("TMPDIR", "/tmp")) / f"browser-{name}.png"))
        raise AssertionError(f"{name}: cells not all run after {RUN_S} s; prompts {prompts}") from exc
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr'] :text('Traceback')")
    assert errors.count() == 0, f"{name}: a cell raised"
    _assert_readable(page, name)
    return page


def _assert_readable(page, name: str) -> None:
    """No table wider than its output area, no slider track collapsed, no control label cut."""
    wide = page.evaluate("""() => [...document.querySelectorAll(
            '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output table')]
        .filter(t => t.offsetParent !== null)
        .map(t => [t.getBoundingClientRect().width, t.closest('.jp-OutputArea-output').clientWidth])
        .filter(([w, room]) => w > room + 1)""")
    assert wide == [], f"{name}: tables wider than the notebook (width, room): {wide}"
    tracks = page.evaluate("""() => [...document.querySelectorAll('.widget-slider .slider-container')]
        .filter(t => t.offsetParent !== null).map(t => t.getBoundingClientRect().width)""")
    assert all(w >= 300 for w in tracks), f"{name}: slider tracks too short to set a value: {tracks}"
    cut = page.evaluate("""() => [...document.querySelectorAll('.widget-label, .widget-label-basic')]
        .filter(l => l.offsetParent !== null && l.scrollWidth > l.clientWidth + 1).map(l => l.textContent)""")
    assert cut == [], f"{name}: control labels cut: {cut}"


def _show_cell(page, text: str) -> None:
    """Scroll the code cell whose source contains `text` into view (JupyterLab skips rendering off-screen cells)."""
    page.evaluate("""(t) => [...document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')]
        .find(c => c.querySelector('.jp-InputArea-editor').textContent.includes(t)).scrollIntoView()""", text)
    time.sleep(1)


def _prompt_of(page, text: str) -> int:
    """The execution count of the code cell whose source contains `text`."""
    return page.evaluate("""(t) => { const c = [...document.querySelectorAll(
            '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell')]
        .find(c => c.querySelector('.jp-InputArea-editor').textContent.includes(t));
        return parseInt(c.querySelector('.jp-InputPrompt').textContent.match(/\\[(\\d+)\\]/)[1]); }""", text)


def _run_check(page, code: str, marker: str = "CHECK") -> list:
    """Append a cell running `code` (one statement printing marker + JSON) in the notebook's kernel; its JSON."""
    import json

    page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").last.click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    page.keyboard.press("Enter")
    page.keyboard.insert_text(code)
    page.keyboard.press("Shift+Enter")
    page.wait_for_function("(m) => [...document.querySelectorAll('.jp-OutputArea-output')]"
                           ".some(e => e.textContent.includes(m))", arg=marker, timeout=300_000)
    text = page.locator(".jp-OutputArea-output", has_text=marker).last.text_content()
    return json.loads(text.split(marker, 1)[1].strip().splitlines()[0])


def _widget_table(page, marker: str) -> list[list[str]]:
    """The cells (td) of the last table in the widget output that contains marker, row by row."""
    out = page.locator(".widget-output", has_text=marker).last
    return out.evaluate("(o) => { const ts = o.querySelectorAll('table'); const t = ts[ts.length - 1];"
                        " return [...t.querySelectorAll('tbody tr')].map(r => [...r.querySelectorAll('td')]"
                        ".map(d => d.textContent.trim())); }")


def _dropdown(page, cell: str, label: str):
    """The dropdown labelled `label` of the explorer in the code cell containing `cell`, scrolled into view."""
    _show_cell(page, cell)
    code = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell").filter(
        has=page.locator(".jp-InputArea-editor", has_text=cell))
    select = code.get_by_label(label, exact=True)  # that cell's own: two explorers of a notebook may share a label
    select.scroll_into_view_if_needed()
    return select


def _set_readout(page, slider_label: str, value: str) -> None:
    """Type a value into a slider's readout, as a reader would."""
    slider = page.locator(".widget-slider", has_text=slider_label).first
    slider.scroll_into_view_if_needed()
    readout = slider.locator(".widget-readout")
    readout.click()
    page.keyboard.press("Control+A")
    page.keyboard.type(value)
    page.keyboard.press("Enter")


def _wait_changed(page, marker: str, before: str, timeout_s: int = 300) -> str:
    page.wait_for_function("([m, before]) => { const o = [...document.querySelectorAll('.widget-output')]"
                           ".filter(e => e.textContent.includes(m)); return o.length && o[o.length - 1]"
                           ".textContent !== before && !o[o.length - 1].textContent.includes('running'); }",
                           arg=[marker, before], timeout=timeout_s * 1000)
    return _widget_output(page, marker)


def _widget_output(page, marker: str) -> str:
    """Text of the widget output area (ipywidgets Output) that contains marker."""
    page.wait_for_function("(m) => [...document.querySelectorAll('.widget-output')]"
                           ".some(e => e.textContent.includes(m))", arg=marker, timeout=60_000)
    return page.locator(".widget-output", has_text=marker).last.text_content()


def test_prefetch_explorer_switches_rules_in_the_browser(lab_url, browser):
    page = _open_and_run(browser, lab_url, "03_prefetch_accuracy.ipynb")
    before = _widget_output(page, "Percentile(")
    _show_cell(page, "widgets.prefetch_explorer(")
    assert "Percentile(q=75.0)" in before
    select = page.locator(".widget-dropdown select").first
    select.scroll_into_view_if_needed()
    select.select_option(label="count budget")
    page.wait_for_function("() => [...document.querySelectorAll('.widget-output')]"
                           ".some(e => e.textContent.includes('CountBudget('))", timeout=60_000)
    after = _widget_output(page, "CountBudget(")
    n = int(re.search(r"CountBudget\(n=(\d+)\)", after).group(1))
    assert n > 0  # a count budget of 0 experts would prefetch nothing
    # the slider that is shown is the count's integer slider, with the model's 32 experts as its maximum
    assert page.locator(".widget-slider:visible").count() == 1
    select.select_option(label="percentile (paper: q=75)")
    page.wait_for_function("() => [...document.querySelectorAll('.widget-output')]"
                           ".some(e => e.textContent.includes('Percentile(q=75'))", timeout=60_000)
    page.close()


def test_cache_explorer_moves_the_boundary_in_the_browser(lab_url, browser):
    page = _open_and_run(browser, lab_url, "04_shallow_favoring_cache.ipynb")
    out = _widget_output(page, "slots per layer")
    _show_cell(page, "widgets.cache_explorer(")
    slider = page.locator(".widget-slider", has_text="L (shallow layers").first
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


def test_decode_explorer_shows_the_run_and_the_prediction_a_direct_call_gives(lab_url, browser):
    page = _open_and_run(browser, lab_url, "05_end_to_end_decode.ipynb")
    marker = "expert slots; one prompt"
    before = _widget_output(page, marker)
    _show_cell(page, "widgets.decode_explorer(")
    _set_readout(page, "cache share", "0.3")
    after = _wait_changed(page, marker, before)
    assert after != before
    shown = _widget_table(page, marker)  # rows: the quantities; cells: measured, predicted, predicted / measured
    n = _prompt_of(page, "widgets.decode_explorer(")
    direct = _run_check(page, (
        f"box = Out[{n}]; import json; from fate_lab.study import show, tables; "
        "L, share = box.children[0].value, box.children[1].value; "
        "cfg = widgets.decode_config(M, E, share, L, LINK, layer_s); "
        "pred = tables.simulated_speed(trace, cfg, hw, shape); "
        "print('CHECK' + json.dumps([share, L, cfg.slots, box.rendered['config'] == cfg, "
        "[show.cell(pred[k]) for k in tables.MEASURED_KEYS], "
        "[show.cell(box.rendered['table'].loc[k, 'measured (runtime)']) for k in tables.MEASURED_KEYS]]))"))
    share, boundary, slots, same_config, predicted, measured = direct
    assert share == 0.3 and same_config, "the widget ran the config its sliders name"
    assert f"{slots} of" in after
    assert [row[1] for row in shown] == predicted  # the prediction shown == a direct call of the simulator
    assert [row[0] for row in shown] == measured  # the measurement shown == what the decode returned
    page.close()


def test_host_and_window_explorers_match_a_direct_call(lab_url, browser):
    page = _open_and_run(browser, lab_url, "07_beyond_fate.ipynb")
    marker = "cache slots; simulated on"
    before = _widget_output(page, marker)
    select = _dropdown(page, "widgets.host_explorer(", "host CPU")
    hosts = select.evaluate("(s) => [...s.options].map(o => o.value)")
    other = next(h for h in hosts if h != select.input_value())
    select.select_option(value=other)
    moved = _wait_changed(page, marker, before)
    _set_readout(page, "host speed", "4")
    after = _wait_changed(page, marker, moved)
    assert " x 4;" in after
    shown = _widget_table(page, marker)
    n = _prompt_of(page, "widgets.host_explorer(")
    direct = _run_check(page, (
        f"box = Out[{n}]; import json; from fate_lab.study import show, tables; "
        "p, s = box.children[0].value, box.children[1].value; "
        "df = tables.host_table(trace, shape, real, slots, p, s); "
        "print('CHECK' + json.dumps([p, s, show.readable(df).text.values.tolist()]))"))
    host, speed, table = direct
    assert host == other and speed == pytest.approx(4.0)
    assert shown == table  # what the widget shows == a direct call of tables.host_table
    # the speculative window explorer of the same notebook
    marker = "simulated, window 0 = plain decoding"
    before = _widget_output(page, marker)
    _show_cell(page, "widgets.window_explorer(")
    _set_readout(page, "window (draft tokens", "2")
    _wait_changed(page, marker, before)
    shown = _widget_table(page, marker)
    n = _prompt_of(page, "widgets.window_explorer(")
    direct = _run_check(page, (
        f"box = Out[{n}]; import json; from fate_lab.study import show, speculative; w = box.children[0].value; "
        "df = speculative.window_table(trace, OffloadConfig.preset('fate', slots=slots), real, shape, w, matches); "
        "cols = ['window', 'acceptance', 'verify_forwards', 'moved_per_token', 'moved_ratio', 'hit_rate', "
        "'decode_tok_s', 'tok_s_ratio']; "
        "print('WINDOWCHECK' + json.dumps([w, show.readable(df[cols].set_index('window')).text.values.tolist()]))"),
        marker="WINDOWCHECK")  # another marker than the first check's, whose output is already there
    window, table = direct
    assert window == 2 and shown == table  # == a direct call of speculative.window_table
    page.close()


def test_threshold_explorer_pairs_a_measured_threshold_with_its_simulated_speed(lab_url, browser):
    page = _open_and_run(browser, lab_url, "08_quality_for_speed.ipynb")
    marker = "quality measured in the runtime"
    before = _widget_output(page, marker)
    select = _dropdown(page, "widgets.threshold_explorer(", "lossy rule")
    options = select.evaluate("(s) => [...s.options].map(o => o.textContent)")
    assert len(options) >= 2
    select.select_option(label=options[1])
    after = _wait_changed(page, marker, before)
    assert after.startswith(options[1]) or f"{options[1]} at threshold" in after
    shown = _widget_table(page, marker)
    n = _prompt_of(page, "widgets.threshold_explorer(")
    direct = _run_check(page, (
        f"box = Out[{n}]; import json; from fate_lab.study import show, tables; "
        "kind, thr = box.children[0].value, float(box.children[1].value); "
        "df = tables.threshold_table(trace, shape, hw, slots, kind, thr, sweep); "
        "print('CHECK' + json.dumps([kind, thr, sorted(sweep.loc[sweep.policy == kind, 'threshold'].tolist()), "
        "show.readable(df).text.values.tolist()]))"))
    kind, thr, measured, table = direct
    assert kind == options[1] and thr in measured  # only measured thresholds are offered
    assert shown == table  # what the widget shows == a direct call of tables.threshold_table
    page.close()


def test_plan_explorer_follows_the_device_and_matches_a_direct_plan(lab_url, browser):
    page = _open_and_run(browser, lab_url, "09_size_your_deployment.ipynb")
    marker = "predicted per preset (best"
    before = _widget_output(page, marker)
    select = _dropdown(page, "widgets.plan_explorer(", "device")
    select.select_option(value="rtx4090")
    after = _wait_changed(page, marker, before)
    assert "on rtx4090" in after
    shown = _widget_table(page, marker)
    n = _prompt_of(page, "widgets.plan_explorer(")
    direct = _run_check(page, (
        f"box = Out[{n}]; import json; from fate_lab.study import show; m, d, ln, b = box.children[:4]; "
        "p = plan.plan(m.value, d.value, f'{b.value}GiB', None if ln.value == widgets.deploy.OWN_LINK else ln.value, "
        "context=CONTEXT, fast=FAST); "
        "print('CHECK' + json.dumps([d.value, show.readable(widgets.deploy.plan_rows(p)).text.values.tolist()]))"))
    device, table = direct
    assert device == "rtx4090" and shown == table
    page.close()
