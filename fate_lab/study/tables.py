"""The tables the notebooks' explorers show, as ordinary functions a test calls without a browser.

What it is: prefetch quality of a selection rule (`prefetch_table`), the replayed cache of one config
(`cache_table`) and a grid of them (`cache_grid`), the simulator's speed of a config (`simulated_speed`),
a real offloaded decode (`decode_point`), host-compute presets against a faster or slower host
(`host_table`) and a lossy rule against fate (`threshold_table`). They take objects -- a `SelectionRule`,
an `OffloadConfig`, a `Trace`, a `Hardware` -- never a widget's string label; `widgets.py` maps labels to
them. Per-trace work (cross-layer scores, predictions, miss curves) is cached per trace object (weakly).
What it is not: a place for metrics (they come from `policy/` and the drivers) or for widgets.
"""
from __future__ import annotations

import dataclasses
import weakref

import pandas as pd
import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.model.trace import Trace
from fate_lab.model.trace import cross_layer_scores as trace_scores
from fate_lab.policy.prediction_metrics import evaluate_rule
from fate_lab.policy.rules import SelectionRule
from fate_lab.sim.replay import miss_curves, predictions_from_rule, replay, sweep

_per_trace: "weakref.WeakKeyDictionary[Trace, dict]" = weakref.WeakKeyDictionary()


def _memo(trace: Trace, key, make):
    """make() once per (trace object, key); forgotten with the trace."""
    d = _per_trace.setdefault(trace, {})
    if key not in d:
        d[key] = make()
    return d[key]


def cross_layer_scores(trace: Trace) -> torch.Tensor:
    """Cross-layer predicted scores ``[N, L-1, E]`` of a trace, computed once per trace object."""
    return _memo(trace, "scores", lambda: trace_scores(trace))


def prefetch_table(trace: Trace, rule: SelectionRule, phase: str = "decode") -> pd.DataFrame:
    """Per-layer prefetch recall, precision and mean set size of one rule (``phase``: decode/prefill/all)."""
    if not isinstance(rule, SelectionRule):
        raise TypeError(f"rule must be a SelectionRule (e.g. Percentile(75)), got {type(rule).__name__}")
    res = evaluate_rule(cross_layer_scores(trace), trace.experts, rule, trace.phase)[phase]
    if res is None or not res.get("per_layer"):
        raise ValueError(f"the trace has no {phase} tokens")
    df = pd.DataFrame(res["per_layer"])
    df.insert(0, "rule", repr(rule))
    return df


def oracle_predictions(trace: Trace) -> list:
    """Exactly the experts each token uses in each next layer (the replay-only upper bound of prediction)."""
    def make():
        ex = trace.experts.tolist()
        return [[None] + [ex[t][l] for l in range(1, trace.num_layers)] for t in range(trace.num_tokens)]

    return _memo(trace, "oracle", make)


def rule_predictions(trace: Trace, rule: SelectionRule) -> list:
    """Per-token predicted ids of a selection rule on the trace's cross-layer scores."""
    return _memo(trace, ("rule", rule), lambda: predictions_from_rule(cross_layer_scores(trace), rule))


def replay_predictions(trace: Trace, config: OffloadConfig) -> list | None:
    """What a replay of `config` prefetches on this trace: the cross-layer rule's sets (None: no predictor)."""
    if config.predictor is None:
        return None
    if config.predictor != "cross_layer_gate":
        raise ValueError(f"the cache tables replay the cross-layer gate; predictor={config.predictor!r} runs in the "
                         "simulator (simulated_speed)")
    from fate_lab.policy.rules import TopK

    return rule_predictions(trace, config.rule if config.rule is not None else TopK(trace.top_k))


def with_miss_curves(config: OffloadConfig, calibration: Trace, predictions: list | None = None) -> OffloadConfig:
    """`config` with the miss curves of its replacement and prefetching, measured on a *different* trace."""
    if calibration is None:
        raise ValueError("the miss_curve allocation needs a calibration trace (a different trace than the one "
                         "replayed, e.g. lab.get_trace(MODEL, split='calib'))")
    preds = predictions if predictions is not None else replay_predictions(calibration, config)
    buffer = 0 if preds is None else (config.prefetch_buffer_experts or calibration.top_k)
    key = ("curves", config.replacement, config.predictor, config.rule, config.admit_prefetch, buffer,
           predictions is not None)
    curves = _memo(calibration, key, lambda: miss_curves(
        calibration.experts, calibration.num_experts, policy=config.replacement, predictions=preds,
        prefetch_buffer=buffer, admit_prefetch=config.admit_prefetch))
    return dataclasses.replace(config, allocation="miss_curve", miss_curves=tuple(map(tuple, curves)))


def cache_table(trace: Trace, config: OffloadConfig, calibration: Trace | None = None,
                oracle: bool = False) -> pd.DataFrame:
    """Per-layer slots and hit rates of one cache config, replayed on the trace (its totals in ``df.attrs``).

    ``oracle``: prefetch exactly the experts each next layer uses (`oracle_predictions`), the replay-only bound,
    instead of the config's predictor; ``calibration``: the trace the miss_curve allocation is measured on."""
    if config.allocation == "miss_curve" and config.miss_curves is None:
        config = with_miss_curves(config, calibration, oracle_predictions(calibration) if oracle else None)
    preds = oracle_predictions(trace) if oracle else replay_predictions(trace, config)
    cfg = dataclasses.replace(config, predictor=None, prefetch_buffer_experts=(
        (config.prefetch_buffer_experts or trace.top_k) if preds is not None else 0))
    st = replay(trace, cfg, predictions=preds)
    rows = [{"layer": m, "slots": st.slots_per_layer[m], "uses": layer["prefill"].uses + layer["decode"].uses,
             "hits": layer["prefill"].hits + layer["decode"].hits,
             "hit_rate_prefill": layer["prefill"].hit_rate if layer["prefill"].uses else float("nan"),
             "hit_rate_decode": layer["decode"].hit_rate if layer["decode"].uses else float("nan"),
             "prefetch_loads": layer["prefill"].prefetch_issued + layer["decode"].prefetch_issued,
             "prefetch_wasted": layer["prefill"].prefetch_wasted + layer["decode"].prefetch_wasted,
             "demand_loads": layer["prefill"].misses + layer["decode"].misses} for m, layer in enumerate(st.layers)]
    df = pd.DataFrame(rows)
    df.attrs["overall"] = {"hit_rate_decode": st.hit_rate("decode"), "hit_rate_prefill": st.hit_rate("prefill"),
                           "hit_rate": st.hit_rate(None)}
    return df


def cache_grid(trace: Trace, boundaries, budgets, replacement: str = "arc", rule: SelectionRule | None = None,
               phase: str = "decode", admit_prefetch: str = "on_use") -> pd.DataFrame:
    """Hit rate over a grid of shallow boundary L x cache_total (rows L, columns budget); `rule` None: no prefetch."""
    preds = None if rule is None else rule_predictions(trace, rule)
    cols = sweep(trace.experts, boundaries=list(boundaries), budgets=list(budgets), num_experts=trace.num_experts,
                 policy=replacement, predictions=preds, phase=trace.phase,
                 prefetch_buffer=0 if preds is None else trace.top_k, admit_prefetch=admit_prefetch)
    df = pd.DataFrame(cols)
    key = "hit_rate" if phase == "all" else f"hit_rate_{phase}"
    return df.pivot(index="boundary", columns="cache_total", values=key)


def simulated_speed(trace: Trace, config: OffloadConfig, hardware, shape) -> dict:
    """The timed simulator's row (`RunStats.row`) for a config: decode hit rate, tok/s, stall."""
    from fate_lab.study.whatif import sim_row

    return sim_row(trace, config, hardware, shape)


def decode_point(model, input_ids, config: OffloadConfig, new_tokens: int = 16) -> dict:
    """One real offloaded decode of `config` (pin its `layer_compute_s` so that every call compares over the same
    link): its stats row."""
    from fate_lab.study.bench import run_preset

    return run_preset(model, input_ids, config, new_tokens)["row"]


def host_table(trace: Trace, shape, hardware, slots: int, profile: str = "desktop_ddr4", speed: float = 1.0,
               presets=("fate", "host_compute", "static_host", "all_host")) -> pd.DataFrame:
    """The simulator's decode tok/s of each preset with the host CPU `profile` made `speed` times faster."""
    from fate_lab.hardware.setups import HostRef
    from fate_lab.study.whatif import sim_row

    if not (isinstance(speed, (int, float)) and 0 < speed < float("inf")):
        raise ValueError(f"host speed={speed!r}: give a factor > 0")
    hw = hardware.for_model(shape.nbytes(None))
    ref = hw.host_ref or HostRef(shape.nbytes(None), shape.expert_flops(), 1.0)
    hw = dataclasses.replace(hw, host_ref=HostRef(ref.expert_bytes, ref.flops_per_token, ref.scale / speed))
    rows = [sim_row(trace, OffloadConfig.preset(p, slots=slots, host_profile=profile), hw, shape) for p in presets]
    df = pd.DataFrame(rows).set_index("config")
    df["speed vs fate"] = df["decode tok/s"] / df.loc["fate", "decode tok/s"] if "fate" in df.index else float("nan")
    return df[["decode tok/s", "speed vs fate", "decode hit rate", "experts moved per token", "stall (ms/token)"]]


def threshold_table(trace: Trace, shape, hardware, slots: int, kind: str, threshold: float,
                    measured: pd.DataFrame | None = None) -> pd.DataFrame:
    """The simulator's decode tok/s of a lossy rule at `threshold` next to fate's, with the quality measured at
    the nearest threshold of `measured` (a `quality.sweep_lossy` table) when given."""
    from fate_lab.study.quality import LOSSY_PRESET
    from fate_lab.study.whatif import sim_row

    if kind not in LOSSY_PRESET:
        raise ValueError(f"unknown lossy rule {kind!r}; choose one of {list(LOSSY_PRESET)}")
    fate = sim_row(trace, OffloadConfig.preset("fate", slots=slots), hardware, shape, "fate")
    knob = {"standin_window": int(threshold)} if kind == "standin" else {"lossy_threshold": threshold}  # standin: window
    row = sim_row(trace, OffloadConfig.preset(LOSSY_PRESET[kind], slots=slots, **knob), hardware,
                  shape, f"{kind} @ {threshold:g}")
    df = pd.DataFrame([fate, row]).set_index("config")[["decode tok/s", "decode hit rate", "experts moved per token"]]
    df["speed vs fate"] = df["decode tok/s"] / df["decode tok/s"].iloc[0]
    if measured is not None and (measured["policy"] == kind).any():
        m = measured[measured["policy"] == kind]
        near = m.loc[(m["threshold"] - threshold).abs().idxmin()]
        df.loc[df.index[1], "measured ppl change (at)"] = f"{near['perplexity change']:+.2%} ({near['threshold']:g})"
        df.loc[df.index[1], "measured agreement"] = near["greedy agreement"]
    return df
