"""Interactive explorers for the notebooks, and the ordinary functions behind them.

What it is: for each widget, a plain function (``prefetch_table``, ``cache_table``,
``cache_grid``) that computes the table it shows from a trace — tests call these without a
browser — and a one-call ``*_explorer(trace)`` that wires sliders/dropdowns to it.
What it is not: a place for metrics; the numbers come from ``predictors`` and ``replay``.
"""
from __future__ import annotations

import pandas as pd
import torch

from fate_lab.model.trace import Trace
from fate_lab.model.trace import cross_layer_scores as trace_scores
from fate_lab.policy import predictors as P
from fate_lab.policy.allocation import allocation_from_name
from fate_lab.sim.replay import miss_curves, predictions_from_rule, replay, sweep

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


def make_rule(trace: Trace, label: str, value=None) -> P.SelectionRule:
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
    return P.rule_from_name(name, **kwargs)


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


_scores_cache: dict[int, torch.Tensor] = {}


def cross_layer_scores(trace: Trace) -> torch.Tensor:
    """Cross-layer predicted scores ``[N, L-1, E]`` of a trace, computed once per trace object."""
    key = id(trace)
    if key not in _scores_cache:
        _scores_cache.clear()
        _scores_cache[key] = trace_scores(trace)
    return _scores_cache[key]


def prefetch_table(trace: Trace, label: str = "percentile (paper: q=75)", value=None, phase: str = "decode") -> pd.DataFrame:
    """Per-layer prefetch recall, precision and mean set size of one rule (``phase``: decode/prefill/all)."""
    rule = make_rule(trace, label, value)
    res = P.evaluate_rule(cross_layer_scores(trace), trace.experts, rule, trace.phase)[phase]
    if res is None or not res.get("per_layer"):
        raise ValueError(f"the trace has no {phase} tokens")
    df = pd.DataFrame(res["per_layer"])
    df.insert(0, "rule", repr(rule))
    return df


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
        df = prefetch_table(trace, rule.value, v, phase.value)
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


def predictions_for(trace: Trace, predictor: str):
    """Per-token predicted ids for a replay, for one of ``PREDICTOR_CHOICES`` (None: no prefetch)."""
    if predictor == "none (cache only)":
        return None
    if predictor == "cross-layer top-k":
        return predictions_from_rule(cross_layer_scores(trace), P.TopK(trace.top_k))
    if predictor == "cross-layer percentile 75":
        return predictions_from_rule(cross_layer_scores(trace), P.Percentile(75.0))
    if predictor == "oracle":
        ex = trace.experts.tolist()
        return [[None] + [ex[t][l] for l in range(1, trace.num_layers)] for t in range(trace.num_tokens)]
    raise ValueError(f"unknown predictor {predictor!r}; choose one of {PREDICTOR_CHOICES}")


_pred_cache: dict[tuple, object] = {}


def _buffer(trace: Trace, predictor: str) -> int:
    """Staging slots for prefetches, as the runtime keeps them: top_k when prefetching, else none."""
    return 0 if predictor == "none (cache only)" else trace.top_k


def _predictions(trace: Trace, predictor: str):
    key = (id(trace), predictor)
    if key not in _pred_cache:
        if len(_pred_cache) > 8:
            _pred_cache.clear()
        _pred_cache[key] = predictions_for(trace, predictor)
    return _pred_cache[key]


ALLOCATION_CHOICES = ("shallow", "uniform", "miss_curve")
ADMIT = "on_use"  # the replay admits prefetched experts as the `fate` preset does: when they are used


def make_allocation(allocation: str, boundary: int, calibration: Trace | None = None,
                    replacement: str = "arc", predictor: str = "cross-layer percentile 75"):
    """An allocator by name; ``miss_curve`` is calibrated on a *different* trace (``calibration``)."""
    if allocation == "shallow":
        return allocation_from_name("shallow", shallow_layers=boundary)
    if allocation == "uniform":
        return allocation_from_name("uniform")
    if allocation == "miss_curve":
        if calibration is None:
            raise ValueError("the miss_curve allocation needs a calibration trace (a different trace "
                             "than the one replayed, e.g. lab.get_trace(MODEL, split='calib'))")
        key = (id(calibration), "curves", replacement, predictor)
        if key not in _pred_cache:
            _pred_cache[key] = miss_curves(calibration.experts, calibration.num_experts, policy=replacement,
                                           predictions=_predictions(calibration, predictor),
                                           prefetch_buffer=_buffer(calibration, predictor), admit_prefetch=ADMIT)
        return allocation_from_name("miss_curve", curves=_pred_cache[key])
    raise ValueError(f"unknown allocation {allocation!r}; choose one of {ALLOCATION_CHOICES}")


def cache_table(trace: Trace, boundary: int, cache_total: int, allocation: str = "shallow",
                replacement: str = "arc", predictor: str = "cross-layer percentile 75",
                calibration: Trace | None = None) -> pd.DataFrame:
    """Per-layer slots and hit rates of one cache configuration, replayed on the trace."""
    alloc = make_allocation(allocation, boundary, calibration, replacement, predictor)
    slots = alloc.allocate(cache_total, trace.num_layers, trace.num_experts)
    res = replay(trace.experts, slots_per_layer=slots, policy=replacement, predictions=_predictions(trace, predictor),
                 phase=trace.phase, prefetch_buffer=_buffer(trace, predictor), admit_prefetch=ADMIT)
    df = pd.DataFrame(res.per_layer)
    df.attrs["overall"] = res.overall
    return df


def cache_grid(trace: Trace, boundaries, budgets, replacement: str = "arc",
               predictor: str = "cross-layer percentile 75", phase: str = "decode") -> pd.DataFrame:
    """Hit rate over a grid of shallow boundary L x cache_total (rows L, columns budget)."""
    cols = sweep(trace.experts, boundaries=list(boundaries), budgets=list(budgets), num_experts=trace.num_experts,
                 policy=replacement, predictions=_predictions(trace, predictor), phase=trace.phase,
                 prefetch_buffer=_buffer(trace, predictor), admit_prefetch=ADMIT)
    df = pd.DataFrame(cols)
    key = "hit_rate" if phase == "all" else f"hit_rate_{phase}"
    return df.pivot(index="boundary", columns="cache_total", values=key)


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
                speed = "\n" + simulated_speed(trace, alloc.value, boundary.value, repl.value, pred.value, budget.value,
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


def simulated_speed(trace: Trace, allocation: str, boundary: int, replacement: str, predictor: str, slots: int,
                    hardware, shape, calibration: Trace | None = None) -> str:
    """One line: the timed simulator's decode hit rate and tok/s for a cache explorer's setting."""
    from fate_lab.sim.whatif import config_for, sim_row

    if replacement == "belady" or predictor == "oracle":
        return "simulator: Belady and the oracle need the future (replay only)"
    row = sim_row(trace, config_for(allocation, boundary, replacement, predictor, slots, calibration), hardware, shape)
    return (f"simulated on {hardware.compute.name}: decode hit {row['hit rate decode']:.3f}, "
            f"{row['predicted decode tok/s']:.1f} tok/s, stall {row['stall (ms/token)']:.1f} ms/token")


def decode_point(model, input_ids, boundary: int, cache_share: float, new_tokens: int = 16,
                 link: str = "qwen15_moe_rtx3090_pcie3", preset: str = "fate",
                 layer_compute_s: float | None = None) -> dict:
    """One real offloaded decode (``preset`` with shallow boundary L and a cache share): its stats row.

    Pass the same ``layer_compute_s`` to every call that a table compares: the scaled link is then
    the same for every row (None calibrates it now, which a shared machine makes noisy).
    """
    from fate_lab.model.adapters import adapt
    from fate_lab.study.bench import run_preset

    if not 0.0 <= cache_share <= 1.0:
        raise ValueError(f"cache_share must lie in [0, 1], got {cache_share}")
    ad = adapt(model)
    slots = int(round(cache_share * ad.num_moe_layers * ad.num_experts))
    return run_preset(model, input_ids, preset, new_tokens, slots=slots, shallow_layers=boundary, link=link,
                      layer_compute_s=layer_compute_s)["row"]


def decode_explorer(model, input_ids, new_tokens: int = 16, link: str = "qwen15_moe_rtx3090_pcie3", tokenizer=None):
    """Sliders for L and the cache share; each change decodes for real with the fate preset, and (with a
    tokenizer) the timed simulator predicts the same run beside it. The link is calibrated once."""
    import ipywidgets as W
    from IPython.display import display

    from fate_lab.model.adapters import adapt
    from fate_lab.model.trace import record_trace
    from fate_lab.sim.simulate import ModelShape
    from fate_lab.sim.whatif import machine_hardware, sim_row

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
                row = decode_point(model, input_ids, boundary.value, share.value, new_tokens, link,
                                   layer_compute_s=layer_s)
                table = pd.DataFrame({"measured (runtime)": row}).drop(index=["preset", "slots"])
                if trace is not None:
                    from fate_lab.offloading.config import OffloadConfig

                    cfg = OffloadConfig.preset("fate", slots=int(round(share.value * M * E)),
                                               shallow_layers=boundary.value)
                    sim = sim_row(trace, cfg, hw, shape)
                    table["predicted (simulator)"] = pd.Series({
                        "decode tok/s": sim["predicted decode tok/s"], "TTFT (ms)": sim["predicted TTFT (ms)"],
                        "hit rate decode": sim["hit rate decode"], "hit rate prefill": sim["hit rate prefill"],
                        "stall decode (ms/token)": sim["stall (ms/token)"]})
                display(table)
        finally:
            status.value = f"link: {link} (calibrated once: layer {layer_s * 1e3:.3f} ms)"
            boundary.disabled = share.disabled = False

    boundary.observe(_draw, names="value")
    share.observe(_draw, names="value")
    _draw()
    return W.VBox([W.HBox([boundary, share]), status, out])


def host_table(trace: Trace, shape, hardware, slots: int, profile: str = "desktop_ddr4", speed: float = 1.0,
               presets=("fate", "host_compute", "static_host", "all_host")) -> pd.DataFrame:
    """The simulator's decode tok/s of each preset with the host CPU `profile` made `speed` times faster."""
    import dataclasses

    from fate_lab.offloading.config import OffloadConfig
    from fate_lab.sim.whatif import sim_row

    if speed <= 0:
        raise ValueError(f"host speed must be > 0, got {speed}")
    ref = hardware.host_ref or (shape.nbytes(None), shape.expert_flops(), 1.0)
    hw = dataclasses.replace(hardware, host_ref=(ref[0], ref[1], ref[2] / speed))
    rows = [sim_row(trace, OffloadConfig.preset(p, slots=slots, host_profile=profile), hw, shape) for p in presets]
    df = pd.DataFrame(rows).set_index("config")
    df["speed vs fate"] = df["predicted decode tok/s"] / df.loc["fate", "predicted decode tok/s"] if "fate" in df.index \
        else float("nan")
    return df[["predicted decode tok/s", "speed vs fate", "hit rate decode", "experts moved per token",
               "stall (ms/token)"]]


def host_explorer(trace: Trace, shape, hardware, slots: int):
    """Dropdown (host CPU profile) and slider (its speed, x) -> the simulator's table of `host_table`.

    The returned box's ``rendered`` dict holds the last table drawn, so a test can read it without a browser.
    """
    import ipywidgets as W
    from IPython.display import display

    from fate_lab.offloading.host import HOST_PROFILES

    profile = W.Dropdown(options=sorted(HOST_PROFILES), value="desktop_ddr4", description="host CPU")
    speed = W.FloatLogSlider(value=1.0, base=2, min=-3, max=3, step=0.5, description="host speed x",
                             continuous_update=False)
    out = W.Output()
    box = W.VBox([W.HBox([profile, speed]), out])
    box.rendered = {}

    def _draw(*_):
        with out:
            out.clear_output(wait=True)
            df = host_table(trace, shape, hardware, slots, profile.value, speed.value)
            box.rendered = {"profile": profile.value, "speed": speed.value, "table": df}
            print(f"{HOST_PROFILES[profile.value].describe()} x {speed.value:g}; {slots} cache slots; "
                  f"simulated on {hardware.compute.name}")
            display(df.round(3))

    profile.observe(_draw, names="value")
    speed.observe(_draw, names="value")
    _draw()
    return box


def threshold_table(trace: Trace, shape, hardware, slots: int, kind: str, threshold: float,
                    measured: pd.DataFrame | None = None) -> pd.DataFrame:
    """The simulator's decode tok/s of a lossy rule at `threshold` next to fate's, with the quality measured
    at the nearest threshold of `measured` (a `quality.sweep_lossy` table) when given."""
    from fate_lab.offloading.config import OffloadConfig
    from fate_lab.sim.whatif import sim_row
    from fate_lab.study.quality import LOSSY_PRESET

    if kind not in LOSSY_PRESET:
        raise ValueError(f"unknown lossy rule {kind!r}; choose one of {list(LOSSY_PRESET)}")
    fate = sim_row(trace, OffloadConfig.preset("fate", slots=slots), hardware, shape, "fate")
    knob = {"standin_window": int(threshold)} if kind == "standin" else {"lossy_threshold": threshold}  # standin: window
    row = sim_row(trace, OffloadConfig.preset(LOSSY_PRESET[kind], slots=slots, **knob), hardware,
                  shape, f"{kind} @ {threshold:g}")
    df = pd.DataFrame([fate, row]).set_index("config")[["predicted decode tok/s", "hit rate decode",
                                                         "experts moved per token"]]
    df["speed vs fate"] = df["predicted decode tok/s"] / df["predicted decode tok/s"].iloc[0]
    if measured is not None and (measured["policy"] == kind).any():
        m = measured[measured["policy"] == kind]
        near = m.loc[(m["threshold"] - threshold).abs().idxmin()]
        df.loc[df.index[1], "measured ppl change (at)"] = f"{near['perplexity change']:+.2%} ({near['threshold']:g})"
        df.loc[df.index[1], "measured agreement"] = near["greedy agreement"]
    return df


def threshold_explorer(trace: Trace, shape, hardware, slots: int, measured: pd.DataFrame | None = None):
    """Dropdown (lossy rule) and slider (threshold) -> `threshold_table`, rerunning the simulator.

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
            df = threshold_table(trace, shape, hardware, slots, kind.value, thr.value, measured)
            box.rendered = {"kind": kind.value, "threshold": thr.value, "table": df}
            display(df.round(3))

    kind.observe(_draw, names="value")
    thr.observe(_draw, names="value")
    _draw()
    return box
