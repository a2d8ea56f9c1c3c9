"""Interactive explorers for the notebooks: each wires sliders and dropdowns to a function of `tables.py`.

What it is: a one-call ``*_explorer(...)`` per notebook widget, and the maps from what a reader picks (a
label) to the objects the table functions take (`make_rule` -> a `SelectionRule`, `cache_config` -> an
`OffloadConfig`). Every number shown comes from `fate_lab.study.tables`, which tests call without a browser;
each explorer's returned box keeps what it drew last in ``box.rendered``.
What it is not: a place for tables or metrics.
"""
from __future__ import annotations

import pandas as pd

from fate_lab.core.config import OffloadConfig
from fate_lab.model.trace import Trace
from fate_lab.policy.rules import Percentile, SelectionRule, rule_from_name
from fate_lab.study import tables

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


def _set_bounds(slider, lo, hi, step, value) -> None:
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
    """Dropdown (rule) + slider (its parameter) -> per-layer recall/precision/set-size plot and table.

    Integer parameters (α, n) get an IntSlider, real ones (q, p) a FloatSlider; only the current
    rule's slider is shown (top-k has none: k is the model's), with bounds from ``rule_parameter``.
    Errors while redrawing show in the output area. The returned box's ``rendered`` dict holds
    what was drawn last (``rule``, ``title``, ``table``), so it can be checked without a browser.
    """
    import ipywidgets as W
    import matplotlib.pyplot as plt
    from IPython.display import display

    from fate_lab.study import plots

    style = {"description_width": "initial"}
    rule = W.Dropdown(options=list(RULE_CHOICES), value="percentile (paper: q=75)", description="rule")
    int_value = W.IntSlider(description="parameter", continuous_update=False, style=style)
    float_value = W.FloatSlider(description="parameter", continuous_update=False, style=style)
    k_note = W.Label(f"k = {trace.top_k} (the model's top-k)")
    phase = W.ToggleButtons(options=["decode", "prefill"], value="decode", description="phase")
    out = W.Output()
    box = W.VBox([W.HBox([rule, int_value, float_value, k_note, phase]), out])
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
            _set_bounds(active, spec["min"], spec["max"], spec["step"], spec["value"])

    def _draw():
        _, active = _active()
        v = None if active is None else active.value
        df = tables.prefetch_table(trace, make_rule(trace, rule.value, v), phase.value)
        title = (f"{rule_caption(trace, rule.value, v)} ({phase.value}): mean set size "
                 f"{df['mean_set_size'].mean():.1f} of {trace.num_experts} experts")
        long = df.melt(id_vars=["layer"], value_vars=["recall", "precision"], var_name="metric")
        fig = plots.per_layer_lines(long, "value", hue="metric", ylabel="fraction", ylim=(0, 1.02), title=title)
        plt.show()
        plt.close(fig)
        display(df.round(3))
        box.rendered = {"rule": make_rule(trace, rule.value, v), "title": title, "table": df}

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


PREDICTOR_CHOICES = ("none (cache only)", "cross-layer top-k", "cross-layer percentile 75", "oracle")
ALLOCATION_CHOICES = ("shallow", "uniform", "miss_curve")


def cache_config(allocation: str, boundary: int, cache_total: int, replacement: str = "arc",
                 predictor: str = "cross-layer percentile 75") -> tuple[OffloadConfig, bool]:
    """The config (prefetching as the `fate` preset admits: on use) and the oracle flag a reader's choices name."""
    if predictor not in PREDICTOR_CHOICES:
        raise ValueError(f"unknown predictor {predictor!r}; choose one of {PREDICTOR_CHOICES}")
    if allocation not in ALLOCATION_CHOICES:
        raise ValueError(f"unknown allocation {allocation!r}; choose one of {ALLOCATION_CHOICES}")
    rule = {"cross-layer top-k": None, "cross-layer percentile 75": Percentile(75.0)}.get(predictor)
    cfg = OffloadConfig("explorer", slots=cache_total, allocation=allocation, shallow_layers=boundary,
                        replacement=replacement, admit_prefetch="on_use", link="instant",
                        predictor=None if predictor in ("none (cache only)", "oracle") else "cross_layer_gate",
                        rule=rule)
    return cfg, predictor == "oracle"


def cache_table(trace: Trace, boundary: int, cache_total: int, allocation: str = "shallow",
                replacement: str = "arc", predictor: str = "cross-layer percentile 75",
                calibration: Trace | None = None) -> pd.DataFrame:
    """`tables.cache_table` of the config a reader's choices name."""
    cfg, oracle = cache_config(allocation, boundary, cache_total, replacement, predictor)
    return tables.cache_table(trace, cfg, calibration, oracle=oracle)


def cache_explorer(trace: Trace, calibration: Trace | None = None, hardware=None, shape=None):
    """Sliders for L and the budget (slots), dropdowns for allocation, replacement and predictor.

    With `hardware` and `shape` (``whatif.machine_hardware`` / ``simulate.ModelShape``), each setting
    is also run through the timed simulator and its predicted decode tok/s is shown.
    """
    import ipywidgets as W
    from IPython.display import display

    from fate_lab.study import plots

    L, E = trace.num_layers, trace.num_experts
    boundary = W.IntSlider(value=min(3, L), min=0, max=L, description="L (shallow)", continuous_update=False)
    budget = W.IntSlider(value=L * E // 2, min=trace.top_k * L, max=L * E, step=max(1, L // 2),
                         description="cache slots", continuous_update=False)
    options = [a for a in ALLOCATION_CHOICES if a != "miss_curve" or calibration is not None]
    alloc = W.Dropdown(options=options, value="shallow", description="allocation")
    repl = W.Dropdown(options=["arc", "lru", "lfu", "lrfu", "belady"], value="arc", description="replacement")
    pred = W.Dropdown(options=list(PREDICTOR_CHOICES), value="cross-layer percentile 75", description="prefetch")
    out = W.Output()

    def _draw(*_):
        with out:
            out.clear_output(wait=True)
            df = cache_table(trace, boundary.value, budget.value, alloc.value, repl.value, pred.value, calibration)
            o = df.attrs["overall"]
            speed = ""
            if hardware is not None and shape is not None:
                speed = "\n" + _speed_line(trace, alloc.value, boundary.value, repl.value, pred.value, budget.value,
                                           hardware, shape, calibration)
            boundary.disabled = alloc.value != "shallow"  # L only means something to the shallow allocation
            long = df.melt(id_vars=["layer"], value_vars=["hit_rate_prefill", "hit_rate_decode"], var_name="phase")
            long["phase"] = long["phase"].map({"hit_rate_prefill": "prefill", "hit_rate_decode": "decode"})
            plots.grouped_bars(long, "layer", "value", "phase", "hit rate", ylim=(0, 1.02),
                               title=f"replayed hit rate: decode {o['hit_rate_decode']:.3f}, prefill "
                                     f"{o['hit_rate_prefill']:.3f}; slots per layer {df['slots'].tolist()}" + speed)
            import matplotlib.pyplot as plt
            plt.show()
            display(df[["layer", "slots", "hit_rate_prefill", "hit_rate_decode", "prefetch_loads",
                        "prefetch_wasted", "demand_loads"]].round(3))
            print(f"L = {boundary.value}, {budget.value} cache slots ({alloc.value}, {repl.value}, {pred.value}); "
                  f"slots per layer {df['slots'].tolist()}" + speed.replace("\n", "\n"))

    for w in (boundary, budget, alloc, repl, pred):
        w.observe(_draw, names="value")
    _draw()
    return W.VBox([W.HBox([boundary, budget]), W.HBox([alloc, repl, pred]), out])


def _speed_line(trace: Trace, allocation: str, boundary: int, replacement: str, predictor: str, slots: int,
                hardware, shape, calibration: Trace | None = None) -> str:
    """One line: the timed simulator's decode hit rate and tok/s for a cache explorer's setting."""
    from fate_lab.study.whatif import config_for

    if replacement == "belady" or predictor == "oracle":
        return "simulator: Belady and the oracle need the future (replay only)"
    row = tables.simulated_speed(trace, config_for(allocation, boundary, replacement, predictor, slots, calibration),
                                 hardware, shape)
    return (f"simulated on {hardware.compute.name}: decode hit {row['decode hit rate']:.3f}, "
            f"{row['decode tok/s']:.1f} tok/s, stall {row['stall (ms/token)']:.1f} ms/token")


def decode_explorer(model, input_ids, new_tokens: int = 16, link: str = "qwen15_moe_rtx3090_pcie3", tokenizer=None):
    """Sliders for L and the cache share; each change decodes for real with the fate preset, and (with a
    tokenizer) the timed simulator predicts the same run beside it. The link is calibrated once."""
    import ipywidgets as W
    from IPython.display import display

    from fate_lab.core.shape import ModelShape
    from fate_lab.model.adapters import adapt
    from fate_lab.model.record import record_trace
    from fate_lab.study.whatif import machine_hardware

    ad = adapt(model)
    M, E = ad.num_moe_layers, ad.num_experts
    hw, layer_s = machine_hardware(model, tokenizer, link) if tokenizer is not None else (None, None)
    if layer_s is None:
        from fate_lab.offloading.runtime import calibrate_layer_time

        layer_s = calibrate_layer_time(model, steps=24)
    trace = record_trace(model, None, [input_ids[0].tolist()], decode_tokens=new_tokens - 1, progress=False) \
        if hw is not None else None
    shape = ModelShape.from_adapter(ad)
    boundary = W.IntSlider(value=min(3, M), min=0, max=M, description="L (shallow layers)", continuous_update=False,
                           style={"description_width": "initial"})
    share = W.FloatSlider(value=0.5, min=0.1, max=1.0, step=0.05, description=f"cache share (of {M * E} experts)",
                          continuous_update=False, style={"description_width": "initial"})
    status = W.Label("")
    out = W.Output()

    def _draw(*_):
        status.value = "running… (a real offloaded decode)"
        boundary.disabled = share.disabled = True
        try:
            with out:
                out.clear_output(wait=True)
                cfg = OffloadConfig.preset("fate", slots=int(round(share.value * M * E)), shallow_layers=boundary.value,
                                           link=link, layer_compute_s=layer_s)
                keys = ["decode tok/s", "TTFT (ms)", "decode hit rate", "prefill hit rate", "stall (ms/token)"]
                row = tables.decode_point(model, input_ids, cfg, new_tokens)
                table = pd.DataFrame({"measured (runtime)": {k: row[k] for k in keys}})
                if trace is not None:
                    sim = tables.simulated_speed(trace, cfg, hw, shape)
                    table["predicted (simulator)"] = pd.Series({k: sim[k] for k in keys})
                display(table)
        finally:
            status.value = f"link: {link} (calibrated once: layer {layer_s * 1e3:.3f} ms)"
            boundary.disabled = share.disabled = False

    boundary.observe(_draw, names="value")
    share.observe(_draw, names="value")
    _draw()
    return W.VBox([W.HBox([boundary, share]), status, out])


def host_explorer(trace: Trace, shape, hardware, slots: int):
    """Dropdown (host CPU profile) and slider (its speed, x) -> the simulator's table of `tables.host_table`.

    The returned box's ``rendered`` dict holds the last table drawn, so a test can read it without a browser.
    """
    import ipywidgets as W
    from IPython.display import display

    from fate_lab.hardware.hosts import HOST_PROFILES

    profile = W.Dropdown(options=sorted(HOST_PROFILES), value="desktop_ddr4", description="host CPU")
    speed = W.FloatLogSlider(value=1.0, base=2, min=-3, max=3, step=0.5, description="host speed x",
                             continuous_update=False)
    out = W.Output()
    box = W.VBox([W.HBox([profile, speed]), out])
    box.rendered = {}

    def _draw(*_):
        with out:
            out.clear_output(wait=True)
            df = tables.host_table(trace, shape, hardware, slots, profile.value, speed.value)
            box.rendered = {"profile": profile.value, "speed": speed.value, "table": df}
            print(f"{HOST_PROFILES[profile.value].describe()} x {speed.value:g}; {slots} cache slots; "
                  f"simulated on {hardware.compute.name}")
            display(df.round(3))

    profile.observe(_draw, names="value")
    speed.observe(_draw, names="value")
    _draw()
    return box


def threshold_explorer(trace: Trace, shape, hardware, slots: int, measured: pd.DataFrame | None = None):
    """Dropdown (lossy rule) and slider (threshold) -> `tables.threshold_table`, rerunning the simulator.

    The simulator replays the plain model's routing, so it predicts the speed; quality comes only from
    measurement (`measured`, the nearest threshold run). ``rendered`` holds the last table.
    """
    import ipywidgets as W
    from IPython.display import display

    from fate_lab.study.quality import LOSSY_PRESET

    kind = W.Dropdown(options=[k for k in LOSSY_PRESET if k != "standin"], value="drop", description="rule")
    thr = W.FloatSlider(value=0.1, min=0.0, max=1.0, step=0.05, description="threshold", continuous_update=False)
    out = W.Output()
    box = W.VBox([W.HBox([kind, thr]), out])
    box.rendered = {}

    def _draw(*_):
        with out:
            out.clear_output(wait=True)
            df = tables.threshold_table(trace, shape, hardware, slots, kind.value, thr.value, measured)
            box.rendered = {"kind": kind.value, "threshold": thr.value, "table": df}
            display(df.round(3))

    kind.observe(_draw, names="value")
    thr.observe(_draw, names="value")
    _draw()
    return box
