"""Explorers of a recorded trace: prefetch rules (notebook 03) and the expert cache (notebook 04).

What it is: `prefetch_explorer` and `cache_explorer`, and the maps from what a reader picks (a label) to the
objects the table functions take (`make_rule` -> a `SelectionRule`, `cache_config` -> an `OffloadConfig`).
Every number shown comes from `fate_lab.study.tables`, which tests call without a browser; each explorer's
returned box keeps what it drew last in ``box.rendered``.
What it is not: a place for tables or metrics.
"""
from __future__ import annotations

import pandas as pd

from fate_lab.core.config import OffloadConfig
from fate_lab.extras import need
from fate_lab.model.trace import Trace
from fate_lab.policy.registry import policy_names
from fate_lab.policy.rules import Percentile, SelectionRule, rule_from_name
from fate_lab.study import tables, whatif

# Rule choices shown to a reader: label -> (rule name, parameter name, default, (min, max, step)).
# An int default marks an integer parameter (IntSlider), a float one a real parameter
# (FloatSlider); a max of None is bounded by the trace (see ``rule_parameter``).
RULE_CHOICES = {
    "top-k": ("topk", None, None, None),
    "top-(k+α)": ("topk_plus", "alpha", 1, (0, None, 1)),
    "percentile (paper: q=75)": ("percentile", "q", 75.0, (50.0, 99.0, 1.0)),
    "cumulative probability": ("cumulative", "p", 0.9, (0.5, 0.99, 0.01)),
    "count budget": ("budget", "n", 8, (1, None, 1)),
}

# Each parameter as the explorer labels it (what it is, with its unit), and as a plot title shows it.
PARAM_LABELS = {"alpha": "extra experts α", "q": "percentile q (%)", "p": "cumulative mass p",
                "n": "experts per layer n"}
_PARAM_CAPTIONS = {"alpha": "α = {:d}", "q": "q = {:g}%", "p": "p = {:.2f}", "n": "n = {:d} experts"}


def make_rule(trace: Trace, label: str, value=None) -> SelectionRule:
    """The selection rule a reader picked by label, with its parameter (k comes from the trace).

    ``value`` None takes the rule's default; an integer parameter (α, n) refuses a fractional value
    rather than truncating it.
    """
    if label not in RULE_CHOICES:
        raise ValueError(f"unknown rule {label!r}; choose one of {list(RULE_CHOICES)}")
    name, param, default, _ = RULE_CHOICES[label]
    kwargs = {}
    if name in ("topk", "topk_plus"):
        kwargs["k"] = trace.top_k
    if param is not None:
        v = default if value is None else value
        if isinstance(default, int):
            if float(v) != int(v):
                raise ValueError(f"{label}: {PARAM_LABELS[param]} must be a whole number, got {v!r}")
            kwargs[param] = int(v)
        else:
            kwargs[param] = float(v)
    return rule_from_name(name, **kwargs)


def rule_parameter(trace: Trace, label: str) -> dict | None:
    """The slider of a rule's parameter on this trace; None when the rule has none (top-k).

    Keys: ``param``, ``kind`` ('int' or 'float'), ``description`` (with its unit), ``min``,
    ``max``, ``step``, ``value`` (the default, inside the bounds) and ``readout_format``. The
    count budget goes up to the trace's number of experts E, the extra experts α up to E - k.
    """
    if label not in RULE_CHOICES:
        raise ValueError(f"unknown rule {label!r}; choose one of {list(RULE_CHOICES)}")
    _, param, default, rng = RULE_CHOICES[label]
    if param is None:
        return None
    lo, hi, step = rng
    if hi is None:
        hi = trace.num_experts - (trace.top_k if param == "alpha" else 0)
    kind = "int" if isinstance(default, int) else "float"
    return {"param": param, "kind": kind, "description": PARAM_LABELS[param], "min": lo, "max": hi, "step": step,
            "value": min(max(default, lo), hi),
            "readout_format": "d" if kind == "int" else (".0f" if step >= 1 else ".2f")}


def rule_caption(trace: Trace, label: str, value=None) -> str:
    """A rule and its parameter as a plot title names them, e.g. ``count budget, n = 4 experts``."""
    name, param, default, _ = RULE_CHOICES[label]
    parts = [label.split(" (")[0]]
    if name in ("topk", "topk_plus"):
        parts.append(f"k = {trace.top_k}")
    if param is not None:
        v = default if value is None else value
        parts.append(_PARAM_CAPTIONS[param].format(int(v) if isinstance(default, int) else float(v)))
    return ", ".join(parts)


def set_bounds(slider, lo, hi, step, value) -> None:
    """Move a slider to ``[lo, hi]`` and ``value`` without ever having min > max on the way.

    ipywidgets refuses ``min > max`` (``TraitError``) and clamps ``value`` into the bounds at each
    step, so the bound on the side the range moves to is set first.
    """
    if lo > slider.max:  # moving up: raise max first, then min
        slider.max = hi
        slider.min = lo
    else:  # moving down or overlapping: lower min first, then max
        slider.min = lo
        slider.max = hi
    slider.step = step
    slider.value = value


def prefetch_explorer(trace: Trace):
    """Dropdown (rule) + slider (its parameter) + phase -> per-layer recall/precision plot and table.

    Integer parameters (α, n) get an IntSlider, real ones (q, p) a FloatSlider; only the current rule's slider
    is shown (top-k has none: k is the model's), with bounds from ``rule_parameter``. The phase names the two
    meanings of prefill (`tables.PHASES`): each prompt token's own set, or the prompt-wide union. Errors while
    redrawing show in the output area. ``box.rendered`` holds what was drawn last (``rule``, ``phase``,
    ``title``, ``table``), so it can be checked without a browser.
    """
    W = need("ipywidgets")
    from IPython.display import display

    from fate_lab.study import plots, show
    from fate_lab.study.widgets import layout

    rule = layout.dropdown("rule", list(RULE_CHOICES), "percentile (paper: q=75)")
    int_value = layout.slider("int", "parameter")
    float_value = layout.slider("float", "parameter")
    k_note = layout.status(f"k = {trace.top_k} (the model's top-k)")
    phase = layout.toggle("phase", [(label, key) for key, label in
                                    (("decode", "decode"), ("prefill", "prefill, per token"),
                                     ("prefill union", "prefill, prompt-wide union"))], "decode")
    out = W.Output()
    box = W.VBox([rule, int_value, float_value, k_note, phase, out], layout=W.Layout(width="100%"))
    box.rendered = {}
    syncing = False  # True while the sliders are moved to a new rule: their changes do not redraw

    def _active():
        spec = rule_parameter(trace, rule.value)
        return spec, (None if spec is None else int_value if spec["kind"] == "int" else float_value)

    def _sync_slider():
        spec, active = _active()
        for s in (int_value, float_value):
            s.layout.display = None if s is active else "none"
        k_note.layout.display = None if RULE_CHOICES[rule.value][0] in ("topk", "topk_plus") else "none"
        if active is not None:
            active.description = spec["description"]
            active.readout_format = spec["readout_format"]
            set_bounds(active, spec["min"], spec["max"], spec["step"], spec["value"])

    def _draw():
        _, active = _active()
        v = None if active is None else active.value
        chosen = make_rule(trace, rule.value, v)
        df = tables.prefetch_table(trace, chosen, phase.value)
        title = (f"{rule_caption(trace, rule.value, v)} ({tables.PHASES[phase.value].split(':')[0]}): mean set size "
                 f"{df['mean_set_size'].mean():.1f} of {trace.num_experts} experts")
        long = df.melt(id_vars=["layer"], value_vars=["recall", "precision"], var_name="metric")
        layout.show_figure(plots.per_layer_lines(long, "value", hue="metric", ylabel="fraction", ylim=(0, 1.02),
                                                 title=title))
        print(f"{repr(chosen)}; {tables.PHASES[phase.value]}")
        display(show.readable(df.drop(columns="rule").set_index("layer"), caption=f"per predicted layer, {title}"))
        box.rendered = {"rule": chosen, "phase": phase.value, "title": title, "table": df}

    def _update(sync: bool = False):
        nonlocal syncing
        with out:  # in a kernel, an error here shows in the output area instead of the kernel log
            out.clear_output(wait=True)
            if sync:
                syncing = True
                try:
                    _sync_slider()
                finally:
                    syncing = False
            _draw()

    rule.observe(lambda _: _update(sync=True), names="value")
    for w in (int_value, float_value, phase):
        w.observe(lambda _: None if syncing else _update(), names="value")
    _update(sync=True)
    return box


PREDICTOR_CHOICES = ("none (cache only)", "cross-layer top-k", "cross-layer percentile 75", "oracle")
ALLOCATION_CHOICES = ("shallow", "uniform", "miss_curve")


def cache_config(allocation: str, boundary: int, cache_total: int, replacement: str = "arc",
                 predictor: str = "cross-layer percentile 75") -> tuple[OffloadConfig, bool]:
    """The config (prefetching as the `fate` preset admits: on use) and the oracle flag a reader's choices name."""
    if predictor not in PREDICTOR_CHOICES:
        raise ValueError(f"unknown predictor {predictor!r}; choose one of {PREDICTOR_CHOICES}")
    if allocation not in ALLOCATION_CHOICES:
        raise ValueError(f"unknown allocation {allocation!r}; choose one of {ALLOCATION_CHOICES}")
    how = {"none (cache only)": None, "cross-layer top-k": "topk", "cross-layer percentile 75": Percentile(75.0),
           "oracle": "oracle"}[predictor]
    return tables.replay_config(allocation, boundary, cache_total, replacement, how)


def cache_table(trace: Trace, boundary: int, cache_total: int, allocation: str = "shallow",
                replacement: str = "arc", predictor: str = "cross-layer percentile 75",
                calibration: Trace | None = None) -> pd.DataFrame:
    """`tables.cache_table` of the config a reader's choices name."""
    cfg, oracle = cache_config(allocation, boundary, cache_total, replacement, predictor)
    return tables.cache_table(trace, cfg, calibration, oracle=oracle)


def cache_explorer(trace: Trace, calibration: Trace | None = None, hardware=None, shape=None):
    """Sliders for L and the budget (slots), dropdowns for allocation, replacement and predictor: each setting is
    replayed (`cache_table`) and, with `hardware` and `shape` (``whatif.machine_hardware`` / ``ModelShape``), run
    through the timed simulator (`speed_line`). ``box.rendered`` holds the last table and speed line."""
    W = need("ipywidgets")
    from IPython.display import display

    from fate_lab.study import plots, show
    from fate_lab.study.widgets import layout

    L, E = trace.num_layers, trace.num_experts
    boundary = layout.slider("int", "L (shallow layers first)", value=min(3, L), min=0, max=L)
    budget = layout.slider("int", f"cache slots (of {L * E} experts)", value=L * E // 2, min=trace.top_k * L,
                           max=L * E, step=max(1, L // 2))
    options = [a for a in ALLOCATION_CHOICES if a != "miss_curve" or calibration is not None]
    alloc = layout.dropdown("allocation", options, "shallow")
    repl = layout.dropdown("replacement", list(policy_names("classic", "bound")), "arc")
    pred = layout.dropdown("prefetch", list(PREDICTOR_CHOICES), "cross-layer percentile 75")
    out = W.Output()
    box = W.VBox([boundary, budget, alloc, repl, pred, out], layout=W.Layout(width="100%"))
    box.rendered = {}

    def _draw(*_):
        with out:
            out.clear_output(wait=True)
            df = cache_table(trace, boundary.value, budget.value, alloc.value, repl.value, pred.value, calibration)
            o = df.attrs["overall"]
            speed = ""
            if hardware is not None and shape is not None:
                speed = speed_line(trace, alloc.value, boundary.value, repl.value, pred.value, budget.value,
                                   hardware, shape, calibration)
            boundary.disabled = alloc.value != "shallow"  # L only means something to the shallow allocation
            long = df.melt(id_vars=["layer"], value_vars=["hit_rate_prefill", "hit_rate_decode"], var_name="phase")
            long["phase"] = long["phase"].map({"hit_rate_prefill": "prefill", "hit_rate_decode": "decode"})
            layout.show_figure(plots.grouped_bars(
                long, "layer", "value", "phase", "hit rate", ylim=(0, 1.02),
                title=f"replayed hit rate: decode {show.cell(o['hit_rate_decode'], 'percent')}, prefill "
                      f"{show.cell(o['hit_rate_prefill'], 'percent')}"))
            print(f"L = {boundary.value}, {budget.value} cache slots ({alloc.value}, {repl.value}, {pred.value}); "
                  f"slots per layer {' '.join(map(str, df['slots']))}")
            if speed:
                print(speed)
            display(show.readable(df[["layer", "slots", "hit_rate_prefill", "hit_rate_decode", "prefetch_loads",
                                      "prefetch_wasted", "demand_loads"]].set_index("layer"),
                                  caption="replayed per layer (no clock: every prefetch arrives in time)"))
            box.rendered = {"table": df, "speed": speed}

    for w in (boundary, budget, alloc, repl, pred):
        w.observe(_draw, names="value")
    _draw()
    return box


def speed_line(trace: Trace, allocation: str, boundary: int, replacement: str, predictor: str, slots: int,
               hardware, shape, calibration: Trace | None = None) -> str:
    """One line: the timed simulator's decode hit rate and tok/s for a cache explorer's setting."""
    from fate_lab.study import show
    from fate_lab.study.whatif import config_for

    if replacement == "belady" or predictor == "oracle":
        return "simulator: Belady and the oracle need the future (replay only)"
    row = tables.simulated_speed(trace, config_for(allocation, boundary, replacement, predictor, slots, calibration),
                                 hardware, shape)
    return (f"simulated on {whatif.describe(hardware)}: "
            f"decode hit rate {show.cell(row['decode hit rate'], 'percent')}, "
            f"{show.cell(row['decode tok/s'])} tok/s, stall {show.cell(row['stall (ms/token)'])} ms/token")
