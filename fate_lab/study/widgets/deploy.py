"""The explorer of notebook 09: pick a model config, a device, a link and a budget; see the plan.

What it is: `plan_explorer` (dropdowns for the model -- the embedded models and the published configs of
`data/configs` --, the device and the link, a slider for the budget up to the device's memory) drawing the
memory plan as stacked bars, the predicted speed per preset as bars and the table behind both, all from one
`plan.plan(...)` call, and `plan_rows` (that table, for a test to compare with).
What it is not: the sizing itself (`fate_lab.study.plan`).
"""
from __future__ import annotations

import pandas as pd

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
    import ipywidgets as W
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
