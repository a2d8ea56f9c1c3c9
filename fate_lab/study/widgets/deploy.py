"""The explorers of notebook 09: fate_lab's runtime presets on a budget, and a llama.cpp placement of a file.

What it is: `plan_explorer` (dropdowns for the model -- the embedded models and the published configs of
`data/configs` --, the device and the link, a slider for the budget up to the device's memory) drawing the
memory plan as stacked bars, the predicted speed per preset as bars and the table behind both, all from one
`plan.plan(...)` call, and `plan_rows` (that table, for a test to compare with); `placement_explorer` (a weight
format, an engine, the host and its RAM, a --n-cpu-moe slider) drawing `placement_table` and decode tok/s
against --n-cpu-moe per format.
What it is not: the sizing itself (`fate_lab.study.plan`, `fate_lab.study.fit`).
"""
from __future__ import annotations

import pandas as pd

from fate_lab.extras import need

SPEED_COLUMNS = ["decode tok/s", "TTFT (ms)", "decode hit rate", "stall (ms/token)", "MiB moved per token",
                 "depends on routing"]
OWN_LINK = "the device's own link"


def plan_rows(p) -> pd.DataFrame:
    """A plan's predicted speed per preset as the explorer shows it (one row per preset)."""
    return pd.DataFrame(p.rows).set_index("config")[SPEED_COLUMNS]


def budget_range(model: str, device: str, context: int = 4096) -> tuple[float, float]:
    """(lowest, highest) budget in GiB worth offering for a model on a device (`plan.budget_steps`)."""
    from fate_lab.study.plan import budget_steps

    steps = budget_steps(model, device, 2, context)
    return (steps[0], steps[-1]) if len(steps) > 1 else (steps[0] * 0.5, steps[0])


def plan_explorer(model: str = "Qwen1.5-MoE-A2.7B", device: str = "rtx3090", budget_gib: float = 12.0,
                  link: str | None = None, context: int = 4096, presets=None, fast: bool = True):
    """Dropdowns (model, device, link) and a budget slider -> `plan.plan` drawn: memory per preset (stacked bars),
    predicted decode tok/s and TTFT per preset (bars), the table. ``box.rendered`` holds the last plan and the
    arguments it was made with."""
    W = need("ipywidgets")
    from IPython.display import display

    from fate_lab.hardware.devices import DEVICES
    from fate_lab.hardware.links import LINK_PROFILES
    from fate_lab.study import plan as P
    from fate_lab.study import plots, show
    from fate_lab.study.widgets import layout

    presets = tuple(presets or P.DEFAULT_PRESETS)
    m = layout.dropdown("model config", P.model_names(), model)
    d = layout.dropdown("device", sorted(DEVICES), device)
    ln = layout.dropdown("link", [OWN_LINK] + sorted(k for k in LINK_PROFILES if k != "test_fast"),
                         link or OWN_LINK)
    lo, hi = budget_range(model, device, context)
    b = layout.slider("float", "budget (GiB of device memory)", value=min(max(budget_gib, lo), hi), min=lo, max=hi,
                      step=(hi - lo) / 100, readout_format=".3g")
    status = layout.status("")
    out = W.Output()
    box = W.VBox([m, d, ln, b, status, out], layout=W.Layout(width="100%"))
    box.rendered = {}
    syncing = False

    def _draw(*_):
        if syncing:
            return
        args = {"model": m.value, "device_name": d.value, "budget": f"{b.value}GiB",
                "link": None if ln.value == OWN_LINK else ln.value, "context": context, "presets": presets,
                "fast": fast}
        status.value = "simulating every preset…"
        with out:
            out.clear_output(wait=True)
            try:
                p = P.plan(**args)
            except ValueError as exc:  # a budget below the dense weights, say: the reader sees why
                print(f"no plan: {exc}")
                box.rendered = {"args": args, "error": str(exc)}
                status.value = ""
                return
            setting = f"{p.model} on {p.device} over {p.link}, {b.value:.3g} GiB, {context:,}-token context"
            print(f"{setting}. Routing: {p.routing}.")
            if p.skipped:
                print("not simulated: " + "; ".join(f"{k} ({v})" for k, v in p.skipped.items()))
            layout.show_figure(plots.memory_plan(pd.DataFrame(p.memory), b.value, f"Memory plan: {setting}"))
            if p.rows:
                layout.show_figure(plots.preset_speed(pd.DataFrame(p.rows), f"Predicted speed: {setting}"))
                display(show.readable(plan_rows(p), caption=f"predicted per preset (best: {p.best}); {setting}"))
            box.rendered = {"args": args, "plan": p}
        status.value = f"best preset: {p.best}"

    def _bounds(*_):
        nonlocal syncing
        syncing = True
        try:
            from fate_lab.study.widgets.trace import set_bounds

            lo, hi = budget_range(m.value, d.value, context)
            set_bounds(b, lo, hi, (hi - lo) / 100, min(max(b.value, lo), hi))
        finally:
            syncing = False
        _draw()

    for w in (ln, b):
        w.observe(_draw, names="value")
    for w in (m, d):
        w.observe(_bounds, names="value")
    _draw()
    return box


def placement_table(model: str, device: str, weights: str, n_cpu_moe: int, host: str = "desktop_ddr4",
                    host_ram: str | None = None, engine: str = "llama.cpp", context: int = 4096,
                    prompt: int = 512) -> pd.DataFrame:
    """One llama.cpp placement's memory and predicted speed, as the placement explorer shows it (one row)."""
    from fate_lab.study.fit import placement, predict_placement, setting

    s = setting(model, device, host, engine, weights, host_ram=host_ram, context=context, prompt=prompt)
    return pd.DataFrame([predict_placement(s, placement(n_cpu_moe=n_cpu_moe)).row()]).set_index("flags")


def placement_explorer(model: str = "Qwen3-30B-A3B", device: str = "rtx3060", weights: str = "q4_k_m",
                       n_cpu_moe: int = 20, host: str = "desktop_ddr4", host_ram: str = "32GiB",
                       formats=("q4_k_m", "q8_0", "bf16"), context: int = 4096):
    """Dropdowns (model, device, weight format, engine), host and RAM fields, a --n-cpu-moe slider -> that
    placement's row (`placement_table`) and decode tok/s against --n-cpu-moe for `formats` and the chosen one
    (`fit.n_cpu_moe_sweep`), the slider's N marked. ``box.rendered`` holds the last table and its arguments."""
    W = need("ipywidgets")
    from IPython.display import display

    from fate_lab.hardware.devices import DEVICES
    from fate_lab.hardware.engines import ENGINES
    from fate_lab.hardware.formats import FORMATS
    from fate_lab.study import fit, plots, show
    from fate_lab.study import plan as P
    from fate_lab.study.widgets import layout

    m = layout.dropdown("model config", [n for n in P.model_names() if n not in P.EMBEDDED_MODELS], model)
    d = layout.dropdown("device", sorted(DEVICES), device)
    f = layout.dropdown("weights (--weights)", list(FORMATS), weights)
    e = layout.dropdown("engine (--engine)", list(ENGINES), "llama.cpp")
    h = W.Text(value=host, description="host (--host)", style={"description_width": layout.LABEL_WIDTH},
               layout=W.Layout(width="98%"))
    r = W.Text(value=host_ram, description="host RAM (--host-ram)", style={"description_width": layout.LABEL_WIDTH},
               layout=W.Layout(width="98%"))
    n = layout.slider("int", "--n-cpu-moe", value=n_cpu_moe, min=0, max=P.model_spec(model).params.n_layers)
    status = layout.status("")
    out = W.Output()
    box = W.VBox([m, d, f, e, h, r, n, status, out], layout=W.Layout(width="100%"))
    box.rendered = {}

    def _draw(*_):
        n.max = P.model_spec(m.value).params.n_layers
        args = dict(model=m.value, device=d.value, weights=f.value, n_cpu_moe=n.value, host=h.value,
                    host_ram=r.value or None, engine=e.value, context=context)
        with out:
            out.clear_output(wait=True)
            try:
                table = placement_table(**args)
                kw = dict(host=h.value, host_ram=r.value or None, engine_name=e.value, context=context)
                sweep = pd.DataFrame(fit.n_cpu_moe_sweep(m.value, d.value, tuple(dict.fromkeys((f.value, *formats))),
                                                         **kw))
            except ValueError as exc:  # a host spec that does not parse, say: the reader sees the one line
                print(f"no plan: {exc}")
                box.rendered = {"args": args, "error": str(exc)}
                return
            setting = f"{m.value} on {d.value}, host {h.value}, {r.value or 'RAM not given'}, engine {e.value}"
            display(show.readable(table, caption=f"{setting}: {table.index[0]}"))
            layout.show_figure(plots.n_cpu_moe_sweep(sweep, f"Decode against --n-cpu-moe: {setting}", n.value))
            box.rendered = {"args": args, "table": table, "sweep": sweep}
        status.value = "" if table["fits"].iloc[0] else f"does not fit: {table['why not'].iloc[0]}"

    for w in (m, d, f, e, h, r, n):
        w.observe(_draw, names="value")
    _draw()
    return box
