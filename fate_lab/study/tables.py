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
from fate_lab.model.trace import DECODE, PREFILL, Trace
from fate_lab.model.trace import cross_layer_scores as trace_scores
from fate_lab.policy.prediction_metrics import evaluate_rule
from fate_lab.policy.registry import policy_names
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


# The two meanings of "prefill" a prefetch table can take (notebook 03 names both):
PHASES = {"decode": "decode: each token's own set",
          "prefill": "prefill, per token: each prompt token's own set",
          "prefill union": "prefill, prompt-wide: the union of a prompt's per-token sets, one per layer"}


def prefetch_table(trace: Trace, rule: SelectionRule, phase: str = "decode") -> pd.DataFrame:
    """Per-layer prefetch recall, precision and mean set size of one rule. ``phase``: "decode", "prefill" (each
    prompt token's own predicted set), "prefill union" (`prefill_union_layers`: one set per prompt and layer,
    the union of its tokens' sets), or "all"."""
    if not isinstance(rule, SelectionRule):
        raise TypeError(f"rule must be a SelectionRule (e.g. Percentile(75)), got {type(rule).__name__}")
    if phase == "prefill union":
        df = prefill_union_layers(trace, rule)
        df.insert(0, "rule", repr(rule))
        return df
    if phase not in ("decode", "prefill", "all"):
        raise ValueError(f"phase {phase!r}: one of {list(PHASES) + ['all']}")
    res = evaluate_rule(cross_layer_scores(trace), trace.experts, rule, trace.phase)[phase]
    if res is None or not res.get("per_layer"):
        raise ValueError(f"the trace has no {phase} tokens")
    df = pd.DataFrame(res["per_layer"])
    df.insert(0, "rule", repr(rule))
    return df


def prefill_union_layers(trace: Trace, rule: SelectionRule) -> pd.DataFrame:
    """Per predicted layer, over the trace's prompts: recall, precision and size of the prompt-wide prefill set
    (`prediction_metrics.prefill_prediction`: the union of the prompt tokens' sets, scored against the union of
    the experts the prompt uses), averaged over prompts."""
    from fate_lab.policy.prediction_metrics import prefill_prediction

    scores, rows = cross_layer_scores(trace), []
    for p in trace.prompt_id.unique().tolist():
        sel = (trace.prompt_id == p) & (trace.phase == 0)
        if not bool(sel.any()):
            continue
        res = prefill_prediction(scores[sel], trace.experts[sel], rule)
        rows += [{"prompt": p, "layer": r["layer"], "recall": r["recall"], "precision": r["precision"],
                  "mean_set_size": float(r["set_size"])} for r in res["per_layer"]]
    if not rows:
        raise ValueError("the trace has no prefill tokens")
    return pd.DataFrame(rows).groupby("layer", as_index=False)[["recall", "precision", "mean_set_size"]].mean()


def rule_table(trace: Trace, rules: dict, phases=("decode", "prefill", "prefill union")) -> pd.DataFrame:
    """Recall, precision and mean set size of each named selection rule (name -> `SelectionRule`) in each phase
    (`PHASES`), one row per (rule, phase): means over (token, layer) pairs, or over (prompt, layer) pairs for the
    prompt-wide prefill."""
    rows = []
    for name, rule in rules.items():
        res = evaluate_rule(cross_layer_scores(trace), trace.experts, rule, trace.phase)
        for phase in phases:
            if phase == "prefill union":
                df = prefill_union_layers(trace, rule)
                m = {k: float(df[k].mean()) for k in ("recall", "precision", "mean_set_size")}
            else:
                m = {k: res[phase][k] for k in ("recall", "precision", "mean_set_size")}
            rows.append({"predictor": name, "phase": phase, **m})
    return pd.DataFrame(rows)


def recall_error(trace: Trace, rule: SelectionRule, phase: str = "decode") -> float:
    """The sampling error of a rule's mean recall in one phase: two standard errors over the phase's tokens and
    over its prompts (the larger: `verdict.mean_uncertainty` of `evaluate_rule`'s ``per_token_recall``)."""
    from fate_lab.study.verdict import mean_uncertainty

    res = evaluate_rule(cross_layer_scores(trace), trace.experts, rule, trace.phase)[phase]
    prompts = (trace.prompt_id if phase == "all"
               else trace.prompt_id[trace.phase == (DECODE if phase == "decode" else PREFILL)])
    return mean_uncertainty(res["per_token_recall"].tolist(), prompts.tolist())


def predictor_table(trace: Trace, predictors: dict, phase: str = "decode") -> pd.DataFrame:
    """Recall, precision and mean set size of each named predictor (name -> `policy.predictors.Predictor`),
    replayed token by token over the trace in one phase."""
    from fate_lab.policy.prediction_metrics import evaluate_predictor

    rows = []
    for name, pred in predictors.items():
        res = evaluate_predictor(pred, trace.experts, phase=trace.phase, prompt_id=trace.prompt_id,
                                 num_experts=trace.num_experts)[phase]
        rows.append({"predictor": name, "phase": phase,
                     **{k: res[k] for k in ("recall", "precision", "mean_set_size")}})
    return pd.DataFrame(rows)


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
    return config.replace(allocation="miss_curve", miss_curves=tuple(map(tuple, curves)))


def cache_table(trace: Trace, config: OffloadConfig, calibration: Trace | None = None,
                oracle: bool = False) -> pd.DataFrame:
    """Per-layer slots and hit rates of one cache config, replayed on the trace (its totals in ``df.attrs``).

    ``oracle``: prefetch exactly the experts each next layer uses (`oracle_predictions`), the replay-only bound,
    instead of the config's predictor; ``calibration``: the trace the miss_curve allocation is measured on."""
    if config.allocation == "miss_curve" and config.miss_curves is None:
        config = with_miss_curves(config, calibration, oracle_predictions(calibration) if oracle else None)
    preds = oracle_predictions(trace) if oracle else replay_predictions(trace, config)
    cfg = config.replace(predictor=None, prefetch_buffer_experts=(
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


def replay_config(allocation: str, boundary: int, cache_total: int, replacement: str = "arc",
                  prefetch: SelectionRule | str | None = None) -> tuple[OffloadConfig, bool]:
    """(config, oracle) of one replayed cache setting: `prefetch` None (cache only), a `SelectionRule` of the
    cross-layer gate, "topk" (the model's top-k) or "oracle" (the replay-only bound); prefetched experts are
    admitted on use, as the `fate` preset does."""
    if allocation not in ("shallow", "uniform", "miss_curve"):
        raise ValueError(f"unknown allocation {allocation!r}; choose 'shallow', 'uniform' or 'miss_curve'")
    if prefetch is not None and not isinstance(prefetch, SelectionRule) and prefetch not in ("topk", "oracle"):
        raise ValueError(f"prefetch={prefetch!r}: None, a SelectionRule, 'topk' or 'oracle'")
    gate = prefetch is not None and prefetch != "oracle"
    cfg = OffloadConfig("explorer", slots=cache_total, allocation=allocation, shallow_layers=boundary,
                        replacement=replacement, admit_prefetch="on_use", link="instant",
                        predictor="cross_layer_gate" if gate else None,
                        rule=prefetch if isinstance(prefetch, SelectionRule) else None)
    return cfg, prefetch == "oracle"


def planner_table(model, fractions=(0.1, 0.25, 0.5, 1.0), context: int = 2048) -> pd.DataFrame:
    """The memory planner on `model` (fp32 as it runs here): for budgets that leave `fractions` of all experts
    cacheable after dense weights, the KV cache at `context` tokens and the buffers, how the budget splits."""
    from fate_lab.model.adapters import adapt
    from fate_lab.policy.planner import plan_memory

    ad = adapt(model)
    L, E, k, eb = ad.num_moe_layers, ad.num_experts, ad.top_k, ad.bytes_per_expert()
    rows = []
    for frac in fractions:
        budget = ad.dense_bytes() + ad.kv_bytes_per_token() * context + int((frac * L * E + 2 * k) * eb)
        p = plan_memory(budget, ad.dense_bytes(), ad.kv_bytes_per_token(), context, eb, L, k,
                        prefetch_buffer_experts=k, num_experts=E)
        rows.append({"budget bytes": budget, "dense bytes": p.dense_bytes, "KV cache bytes": p.kv_bytes,
                     "buffer bytes": p.buffer_bytes, "cache slots": p.cache_total,
                     "share of all experts": p.cache_total / (L * E)})
    return pd.DataFrame(rows)


def allocation_table(trace: Trace, calibration: Trace, fractions, allocations=(("uniform", 0), ("shallow", 3),
                     ("shallow", 4), ("miss_curve", 0)), prefetch: dict | None = None,
                     replacement: str = "arc") -> pd.DataFrame:
    """Replayed hit rates and transfers of each (allocation, L) x prefetch (name -> `replay_config`'s prefetch;
    default: none, and the paper's percentile rule) at cache sizes of `fractions` of all experts."""
    from fate_lab.policy.rules import Percentile

    prefetch = prefetch or {"none (cache only)": None, "cross-layer percentile 75": Percentile(75.0)}
    rows = []
    for frac in fractions:
        total = int(frac * trace.num_layers * trace.num_experts)
        for alloc, L in allocations:
            for pred, how in prefetch.items():
                cfg, oracle = replay_config(alloc, L, total, replacement, how)
                df = cache_table(trace, cfg, calibration, oracle=oracle)
                o = df.attrs["overall"]
                rows.append({"cache slots": total, "share": frac,
                             "allocation": alloc + (f" L={L}" if alloc == "shallow" else ""), "prefetch": pred,
                             "decode hit rate": o["hit_rate_decode"], "prefill hit rate": o["hit_rate_prefill"],
                             "experts moved": int(df["demand_loads"].sum() + df["prefetch_loads"].sum()),
                             "prefetches wasted": int(df["prefetch_wasted"].sum()),
                             "slots per layer": df["slots"].tolist()})
    return pd.DataFrame(rows)


GRID_POLICIES = policy_names("classic", "bound")  # the classic policies and Belady's bound


def replacement_grid(trace: Trace, cache_total: int, policies=GRID_POLICIES,
                     prefetch: dict | None = None) -> pd.DataFrame:
    """Replayed decode hit rate and experts moved of each replacement policy (uniform slots), with and without
    cross-layer prefetch (as `allocation_table`); one row per (policy, prefetch)."""
    from fate_lab.policy.rules import Percentile

    prefetch = prefetch or {"none (cache only)": None, "cross-layer percentile 75": Percentile(75.0)}
    rows = []
    for repl in policies:
        for pred, how in prefetch.items():
            cfg, oracle = replay_config("uniform", 0, cache_total, repl, how)
            df = cache_table(trace, cfg, oracle=oracle)
            rows.append({"replacement": repl, "prefetch": pred,
                         "decode hit rate": df.attrs["overall"]["hit_rate_decode"],
                         "experts moved": int(df["demand_loads"].sum() + df["prefetch_loads"].sum())})
    return pd.DataFrame(rows)


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


def ratio_where_defined(predicted: pd.Series, measured: pd.Series) -> pd.Series:
    """predicted / measured, NaN ("—") where the measurement is 0: a run with no stall has no stall ratio."""
    return predicted / measured.where(measured != 0)


MEASURED_KEYS = ("decode tok/s", "TTFT (ms)", "decode hit rate", "prefill hit rate", "stall (ms/token)",
                 "experts moved per token")


def measured_and_predicted(model, input_ids, trace: Trace, config: OffloadConfig, hardware, shape,
                           new_tokens: int) -> pd.DataFrame:
    """One real offloaded decode of `config` (`decode_point`) beside the simulator's prediction of the same run:
    `trace` must be recorded from the same prompt (its one prompt's prefill is `input_ids`), so that TTFT is
    predicted for the same prompt and budget it is measured for. Rows `MEASURED_KEYS`; columns measured,
    predicted and their ratio."""
    n_prefill = int((trace.phase == 0).sum())
    if trace.prompt_id.unique().numel() != 1 or n_prefill != input_ids.shape[1]:
        raise ValueError(f"the trace holds {trace.prompt_id.unique().numel()} prompt(s) and {n_prefill} prefill "
                         "tokens; "
                         f"record it from the measured prompt ({input_ids.shape[1]} tokens): record_trace(model, tok, "
                         "[input_ids[0].tolist()], decode_tokens=new_tokens - 1)")
    measured = decode_point(model, input_ids, config, new_tokens)
    predicted = simulated_speed(trace, config, hardware, shape)
    df = pd.DataFrame({"measured (runtime)": {k: measured[k] for k in MEASURED_KEYS},
                       "predicted (simulator)": {k: predicted[k] for k in MEASURED_KEYS}})
    df["predicted / measured"] = ratio_where_defined(df["predicted (simulator)"], df["measured (runtime)"])
    df.index.name = "quantity"
    return df


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
    """The simulator's decode tok/s of a lossy rule at `threshold` next to fate's; with `measured` (a
    `quality.sweep_lossy` table) the quality and the runtime's speed measured at that very threshold beside it
    ('—' when that threshold was not measured)."""
    from fate_lab.study.quality import LOSSY_PRESET
    from fate_lab.study.whatif import sim_row

    if kind not in LOSSY_PRESET:
        raise ValueError(f"unknown lossy rule {kind!r}; choose one of {list(LOSSY_PRESET)}")
    fate = sim_row(trace, OffloadConfig.preset("fate", slots=slots), hardware, shape, "fate")
    # standin: a window
    knob = {"standin_window": int(threshold)} if kind == "standin" else {"lossy_threshold": threshold}
    row = sim_row(trace, OffloadConfig.preset(LOSSY_PRESET[kind], slots=slots, **knob), hardware,
                  shape, f"{kind} @ {threshold:g}")
    df = pd.DataFrame([fate, row]).set_index("config")[["decode tok/s", "decode hit rate", "experts moved per token"]]
    df = df.rename(columns={"decode tok/s": "simulated decode tok/s", "decode hit rate": "simulated decode hit rate"})
    df["simulated speed vs fate"] = df["simulated decode tok/s"] / df["simulated decode tok/s"].iloc[0]
    nan = float("nan")
    df["measured speed vs fate"], df["perplexity change"], df["greedy agreement"] = nan, nan, nan
    if measured is not None:
        base = measured[measured["policy"] == "fate"]
        if len(base):
            b = base.iloc[0]
            df.loc["fate", ["measured speed vs fate", "perplexity change", "greedy agreement"]] = [
                b.get("speed vs fate", nan), b["perplexity change"], b["greedy agreement"]]
        m = measured[(measured["policy"] == kind) & ((measured["threshold"] - threshold).abs() < 1e-9)]
        if len(m):
            r = m.iloc[0]
            df.loc[df.index[1], ["measured speed vs fate", "perplexity change", "greedy agreement"]] = [
                r.get("speed vs fate", nan), r["perplexity change"], r["greedy agreement"]]
    return df
