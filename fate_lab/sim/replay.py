"""Trace replay of the per-layer expert cache: hit rates, bytes moved, wasted prefetches -- no clock.

What this file is: the third driver of the one expert cache. `replay(trace, config)` takes the cache-related
part of the same `OffloadConfig` the runtime and the simulator take (slots or budget and allocation,
replacement, prefetch buffers and admission, the predictor), builds it through the same driver core, and
drives THE runtime's cache (`policy/cache.ExpertCache`) with transfers that land at once, one token and one
layer at a time, in the runtime's order:

(a) prefetch: the experts predicted for layer l (made while layer l-1 ran) are queued most probable first,
    as the runtime queues them: admitted into the cache (``admit_prefetch="on_load"``, protecting the rest
    of the predicted set) or held in staging slots until used (``"on_use"``; a used one then enters the
    cache); what finds no slot moves nothing;
(b) the token's experts of layer l are classified (resident or not) and computed in the runtime's order:
    hits first, then misses, each loaded on demand while the token's other experts of the layer are
    protected. That order is what the replacement policy sees.

It returns the runtime's own `RunStats` (no forward times: a replay has no clock, so no speeds). Layers are
independent (each has its own slots, policy, predictions and staging pool), so results are computed per
(layer, slots) and `sweep` / `miss_curves` reuse them across a grid. The replay has no clock: a prefetch
always arrives. For time, the batched prefill step and the link, use `fate_lab.sim.simulate` (same cache;
equal counts with an instant link on decode traces, tested). Prefill tokens are replayed one by one.
Research hooks beside the config: `policy=` a replacement factory ``capacity -> ReplacementPolicy`` (or a
name) with `policy_kw`, and `predictions=` given sets instead of the config's predictor.
"""
from __future__ import annotations

import operator
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from fate_lab.core.config import OffloadConfig
from fate_lab.core.driver import DriverCore
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.setups import Hardware
from fate_lab.model.trace import router_scores
from fate_lab.policy.allocation import ShallowFavoringAllocation
from fate_lab.policy.prediction_metrics import predict_trace
from fate_lab.policy.registry import POLICIES, policy_from_name
from fate_lab.policy.rules import RouterScores, SelectionRule
from fate_lab.policy.stats import PHASES, PhaseStats, RunStats
from fate_lab.sim.fast_replay import PredictedSets, fast_supported
from fate_lab.sim.layer_replay import (
    LayerStats,
    PolicySpec,
    check_policy,
    fast_layers,
    make_policy,
    replay_layer,
    replay_layer_pure,
    run_layers,
)

Predictions = list  # list[N] of list[L] of (list[int] | None)


def predictions_from_rule(pred_scores: Tensor, rule: SelectionRule) -> Predictions:
    """Predicted ids per token and layer from cross-layer scores ``[N, L-1, E]``; ``out[t][0]`` is None."""
    N, Lm1, E = pred_scores.shape
    flat = rule.ids(pred_scores.reshape(N * Lm1, E))
    return [[None] + flat[t * Lm1 : (t + 1) * Lm1] for t in range(N)]


def _prepare(experts, predictions: Predictions | None, phase):
    """(uses per layer, predictions per layer, phase per token, L, k, trace or None, ids [N, L, k]) from a Trace or
    a tensor."""
    from fate_lab.model.trace import Trace

    trace = experts if isinstance(experts, Trace) else None
    if trace is not None:
        phase = trace.phase if phase is None else phase
        experts = trace.experts
    ex = torch.as_tensor(experts)
    if ex.dim() != 3:
        raise ValueError(f"experts must be [N, L, k], got shape {tuple(ex.shape)}")
    if ex.is_floating_point():
        raise TypeError(f"expert ids must be integers, got dtype {ex.dtype}")
    if trace is None:  # a bare tensor gets the checks a Trace has: ids >= 0, k distinct ids per row, >= 1 token
        from fate_lab.model.trace import from_routing_array

        from_routing_array(ex, num_experts=int(ex.max()) + 1 if ex.numel() else 1)
    N, L, k = ex.shape
    if isinstance(phase, str):
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r}: give 'prefill', 'decode', or one 0/1 per token")
        phase = torch.full((N,), PHASES.index(phase))
    uses = _LayerUses(ex)
    preds = None
    if isinstance(predictions, PredictedSets):
        if predictions.offsets.shape != (L, N + 1):
            raise ValueError(f"predictions cover {predictions.offsets.shape[0]} layers x "
                             f"{predictions.offsets.shape[1] - 1} tokens, the trace {L} x {N}")
        preds = [predictions.layer_lists(l) for l in range(L)]
    elif predictions is not None:
        if len(predictions) != N:
            raise ValueError(f"predictions has {len(predictions)} tokens, the trace {N}")
        preds = [[predictions[t][l] for t in range(N)] for l in range(L)]
    phases = np.ones(N, np.int8) if phase is None else torch.as_tensor(phase).reshape(-1).numpy()  # (N,)
    if len(phases) != N or not np.isin(phases, (0, 1)).all():
        raise ValueError(f"phase must hold one 0 (prefill) or 1 (decode) per token ({N} tokens)")
    phases = phases.astype(np.int8, copy=False)
    return uses, preds, phases, L, k, trace, ex


class _LayerUses:
    """``uses[l]``: layer l's ids per token as Python lists, made when the pure cache asks for that layer.

    The compiled replay reads the array itself, so a call it covers never pays for lists (converting a
    180k-token x 26-layer array to lists takes longer than replaying it).
    """

    def __init__(self, ex: Tensor):
        self.ex, self.made = ex, {}

    def __len__(self) -> int:
        return self.ex.shape[1]

    def __getitem__(self, l: int) -> list[list[int]]:
        if l not in self.made:
            self.made[l] = self.ex[:, l].tolist()
        return self.made[l]


def trace_shape(trace_or_experts, num_experts: int | None = None) -> ModelShape:
    """A shape for a replay given no model: the trace's layers, experts and top-k, and no bytes to speak of (a
    replay without a shape counts experts moved in `bytes_moved`, one unit each)."""
    from fate_lab.model.trace import Trace

    ex = trace_or_experts.experts if isinstance(trace_or_experts, Trace) else torch.as_tensor(trace_or_experts)
    E = num_experts or (trace_or_experts.num_experts if isinstance(trace_or_experts, Trace) else
                        int(ex.max()) + 1 if ex.numel() else 1)
    return ModelShape(ex.shape[1], ex.shape[1], max(E, 1), ex.shape[2], 1, 1, torch.float32, 0, 0)


def _router(trace, router, needed: bool) -> RouterScores | None:
    """The router scores a replay reads: the model's own routers where given, else the trace's (which refuses a
    router its weights cannot reproduce); None where nothing reads them or the trace has none (callers refuse)."""
    if not needed:
        return None
    if router is not None:
        return router
    if trace is None or trace.gate_inputs is None or trace.router_weights is None:
        return None
    return router_scores(trace)


def _config_predictions(core: DriverCore, trace, router: RouterScores | None) -> Predictions | None:
    """The sets the config's predictor makes for every token and layer, in the runtime's order (prefill tokens
    one by one, as the replay runs them)."""
    pred = core.predictor
    if pred is None:
        return None
    gi = None if trace is None or trace.gate_inputs is None else trace.gate_inputs.float()
    if core.config.predictor in ("cross_layer_gate", "learned_gate") and (gi is None or router is None):
        raise ValueError(f"predictor {core.config.predictor!r} reads gate inputs and router weights: replay a Trace "
                         "recorded with record_trace, or set predictor=None / 'activation_path'")
    scores = None
    if gi is not None and router is not None and gi.shape[1] > 1 and pred.scores(0, gi[:1, 0], router) is not None:
        scores = torch.stack([pred.scores(l, gi[:, l], router) for l in range(gi.shape[1] - 1)], dim=1)  # (N, L-1, E)
    ex = trace.experts if trace is not None else None
    return predict_trace(pred, ex, scores, None if trace is None else trace.prompt_id)


def _summ(layer_stats: list[LayerStats], slots: list[int], shape: ModelShape, plan, link_bytes: int,
          expert_bytes: int) -> RunStats:
    for ls in layer_stats:
        for s in ls.values():
            s.bytes_moved *= link_bytes
    return RunStats(layers=layer_stats, link="instant (replay: transfers land at once)", store="replay", plan=plan,
                    slots_per_layer=list(slots), driver="replay", expert_bytes=expert_bytes)


def replay(experts, config: OffloadConfig | None = None, *, shape: ModelShape | None = None,
           slots_per_layer: Sequence[int] | int | None = None, policy: PolicySpec | None = None,
           predictions: Predictions | None = None, phase: Tensor | str | None = None,
           policy_kw: dict | None = None, prefetch_buffer: int | None = None,
           admit_prefetch: str | None = None, expert_bytes: int | None = None, fast: bool = True,
           router=None, n_jobs: int = 1) -> RunStats:
    """Replay a routing trace through per-layer caches (semantics in the module docstring).

    ``config``: the `OffloadConfig` whose cache-related part runs (default: LRU, no predictor); the slots
    come from its plan (``slots_per_layer``, ``slots`` or ``budget``: a budget needs ``shape``).
    Conveniences that build that config: ``slots_per_layer`` (one int or a list), ``policy`` (a name, or a
    factory ``capacity -> ReplacementPolicy``; ``policy_kw`` for its parameters), ``prefetch_buffer`` and
    ``admit_prefetch``. ``predictions[t][l]``: ids predicted for layer l of token t (None: the config's
    predictor, from the trace). ``expert_bytes``: the unit of bytes_moved (default: the shape's expert).
    ``router``: the model's own routers (`MoEAdapter.host_routers()`), for a router the trace's weights cannot
    reproduce (default: the trace's, with its logit biases). ``fast``: the compiled replay where it covers the
    policy (same counts; False: the uncompiled cache). ``n_jobs``: threads of the compiled replay, one layer each at
    a time (-1: every core; the counts do not depend on it).
    """
    if policy is not None:
        check_policy(policy)
    _check_n_jobs(n_jobs)
    uses, preds, phases, L, k, trace, ex = _prepare(experts, predictions, phase)
    unit = expert_bytes if expert_bytes is not None else 1 if shape is None else shape.nbytes(None)
    config = _replay_config(config, L, slots_per_layer, policy, prefetch_buffer, admit_prefetch)
    if shape is None:  # ids seen are a lower bound on a bare tensor's expert count; slots asked for may say more
        shape = trace_shape(experts, max(trace_shape(experts).num_experts, max(config.slots_per_layer or (0,))))
    core = DriverCore(config, shape, Hardware(None, None), driver="replay")
    pol_spec = policy if policy is not None and not isinstance(policy, str) else config.replacement
    kw = policy_kw or {}
    compiled = fast and fast_supported(pol_spec, kw)
    E = shape.num_experts
    pols = [] if compiled else [make_policy(pol_spec, s, uses[l], kw, E) for l, s in enumerate(core.slots_per_layer)]
    scores = POLICIES[pol_spec.lower()].needs_scores if isinstance(pol_spec, str) else any(p.wants_scores for p in pols)
    reads_router = config.predictor in ("cross_layer_gate", "learned_gate") and preds is None
    router = _router(trace, router, reads_router or scores)
    if preds is None and config.predictor is not None:
        p = _config_predictions(core, trace, router)
        preds = [[p[t][l] for t in range(len(p))] for l in range(L)]
    probs = [None] * L
    if scores:
        if router is None:
            raise ValueError("this replacement policy reads the router's probabilities: replay a Trace recorded "
                             "with gate inputs and router weights (record_trace)")
        gi = trace.gate_inputs.float()
        probs = [router.scores(l, gi[:, l]) for l in range(L)]
    buffer = core.prefetch_buffers if preds is not None else 0
    if compiled:
        stacked = torch.stack(probs, dim=1).double().numpy() if scores else None  # [N, L, E]
        stats = fast_layers(ex, preds, phases, pol_spec, kw, list(enumerate(core.slots_per_layer)), buffer,
                            config.admit_prefetch, n_jobs, stacked, E)
    else:
        probs = [None if p is None else p.tolist() for p in probs]
        stats = [replay_layer(uses[l], None if preds is None else preds[l], phases.tolist(), pols[l], buffer, k,
                               config.admit_prefetch, probs[l]) for l in range(L)]
    return _summ(stats, core.slots_per_layer, shape, None if config.slots_per_layer else core.plan, unit, unit)


def _check_admit(admit_prefetch) -> None:
    if admit_prefetch not in ("on_use", "on_load"):
        raise ValueError(f"admit_prefetch={admit_prefetch!r}; choose 'on_use' (staged until used) or 'on_load'")


def _replay_config(config, L, slots_per_layer, policy, prefetch_buffer, admit_prefetch) -> OffloadConfig:
    """The config a replay runs: the given one (conveniences may not contradict it), or one built from them."""
    if config is not None:
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
        given = {k: v for k, v in (("slots_per_layer", slots_per_layer), ("prefetch_buffer", prefetch_buffer),
                                   ("admit_prefetch", admit_prefetch)) if v is not None}
        if isinstance(policy, str):
            given["policy"] = policy
        if given:
            raise TypeError(f"replay(config=...) takes its settings from the config; drop {sorted(given)} "
                            "(or set them on the config with dataclasses.replace)")
        return config
    if slots_per_layer is None:
        raise TypeError("replay needs a config or slots_per_layer (one int for every layer, or a list)")
    slots = _slots(slots_per_layer, L)
    name = policy if isinstance(policy, str) else "lru"
    if name.lower() not in ("belady",):
        policy_from_name(name, 1)  # an unknown name fails here, naming the known ones
    return OffloadConfig("replay", predictor=None, allocation="uniform", replacement=name.lower(),
                         slots_per_layer=tuple(slots), prefetch_buffer_experts=prefetch_buffer or 0,
                         admit_prefetch=admit_prefetch or "on_load", link="instant")


def _slots(slots_per_layer, L: int) -> list[int]:
    """One int (any integer type, numpy's included) for every layer, or a list of L ints >= 0."""
    try:
        slots = [operator.index(slots_per_layer)] * L
    except TypeError:
        if isinstance(slots_per_layer, (str, bytes)) or not hasattr(slots_per_layer, "__iter__"):
            raise ValueError(f"slots_per_layer={slots_per_layer!r}: give one int for every layer or a list of {L} "
                             "ints") from None
        slots = list(slots_per_layer)
    if isinstance(slots_per_layer, bool) or any(isinstance(s, bool) or not hasattr(s, "__index__") for s in slots):
        raise ValueError(f"slots_per_layer must hold non-negative ints, got {slots_per_layer!r}")
    slots = [operator.index(s) for s in slots]
    if len(slots) != L:
        raise ValueError(f"slots_per_layer has {len(slots)} entries for {L} layers")
    if any(s < 0 for s in slots):
        raise ValueError(f"slots_per_layer must hold non-negative ints, got {slots}")
    return slots


def sweep(experts, *, boundaries: Sequence[int], budgets: Sequence[int], num_experts: int,
          policy: PolicySpec = "arc", predictions: Predictions | None = None, phase: Tensor | None = None,
          expert_bytes: int = 1, allocation: Callable[[int], object] = ShallowFavoringAllocation,
          policy_kw: dict | None = None, prefetch_buffer: int = 0, admit_prefetch: str = "on_load",
          n_jobs: int = 1, max_replays: int = 200_000, fast: bool = True) -> dict[str, list]:
    """Replay every (shallow boundary L, cache_total) pair; columns of a table (``pd.DataFrame(out)``).

    ``budgets`` are ``cache_total`` slot counts; ``allocation(L)`` builds the allocator (Fate's
    shallow-favoring one by default). Layer results are cached per (layer, slots), so the grid
    costs at most ``num_layers * (num_experts + 1)`` layer replays (refused above ``max_replays``), which run
    in ``n_jobs`` processes (joblib; -1: every core; a cluster user can wrap the call in
    ``joblib.parallel_backend("ray")``), or in ``n_jobs`` threads of the compiled replay (``fast``).
    """
    _check_admit(admit_prefetch)
    check_policy(policy)
    _check_n_jobs(n_jobs)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r}: give the experts per layer, an int >= 1")
    uses, preds, phases, L, top_k, trace, ex = _prepare(experts, predictions, phase)
    _check_experts(trace, ex, num_experts)
    far = [b for b in boundaries if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= L]
    if far:
        raise ValueError(f"boundaries {far}: a shallow boundary is a layer count from 0 to the trace's {L} layers")
    kw = policy_kw or {}
    pairs = sorted({(l, s) for b in boundaries for budget in budgets
                    for l, s in enumerate(allocation(b).allocate(budget, L, num_experts))})
    _bound(len(pairs), max_replays, "sweep")
    memo = dict(zip(pairs, run_layers(ex, uses, preds, phases, policy, kw, pairs, prefetch_buffer, top_k,
                                      admit_prefetch, n_jobs, fast), strict=False))
    cols: dict[str, list] = {k: [] for k in ("boundary", "cache_total", "slots", "hit_rate", "hit_rate_prefill",
                                             "hit_rate_decode", "misses", "bytes_moved", "prefetch_loads",
                                             "prefetch_wasted")}
    for b in boundaries:
        alloc = allocation(b)
        for budget in budgets:
            slots = alloc.allocate(budget, L, num_experts)
            tot = {p: PhaseStats() for p in PHASES}
            for l, s in enumerate(slots):
                for p in PHASES:
                    tot[p].add(memo[(l, s)][p])
            both = PhaseStats()
            both.add(tot["prefill"])
            both.add(tot["decode"])
            cols["boundary"].append(b)
            cols["cache_total"].append(budget)
            cols["slots"].append(slots)
            cols["hit_rate"].append(both.hit_rate if both.uses else None)
            cols["hit_rate_prefill"].append(tot["prefill"].hit_rate if tot["prefill"].uses else None)
            cols["hit_rate_decode"].append(tot["decode"].hit_rate if tot["decode"].uses else None)
            cols["misses"].append(both.uses - both.hits)
            cols["bytes_moved"].append(both.bytes_moved * expert_bytes)
            cols["prefetch_loads"].append(both.prefetch_issued)
            cols["prefetch_wasted"].append(both.prefetch_wasted)
    return cols


def miss_curves(experts, num_experts: int, *, policy: PolicySpec = "lru", predictions: Predictions | None = None,
                policy_kw: dict | None = None, prefetch_buffer: int = 0, admit_prefetch: str = "on_load",
                n_jobs: int = 1, max_replays: int = 200_000, fast: bool = True) -> list[list[int]]:
    """``curves[l][c]`` = misses of layer l with c slots (c = 0..E), prefetching included.

    Feed to ``allocation.MissCurveAllocation`` to allocate for the policy and predictor in use.
    The L x (E + 1) layer replays (refused above ``max_replays``) run in ``n_jobs`` processes (joblib; -1:
    every core), or in ``n_jobs`` threads of the compiled replay (``fast``).
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r}: give the experts per layer, an int >= 1")
    _check_admit(admit_prefetch)
    check_policy(policy)
    _check_n_jobs(n_jobs)
    uses, preds, phases, L, k, trace, ex = _prepare(experts, predictions, None)
    _check_experts(trace, ex, num_experts)
    _bound(L * (num_experts + 1), max_replays, "miss_curves")
    kw = policy_kw or {}
    pairs = [(l, c) for l in range(L) for c in range(num_experts + 1)]
    res = run_layers(ex, uses, preds, phases, policy, kw, pairs, prefetch_buffer, k, admit_prefetch, n_jobs, fast)
    E1 = num_experts + 1
    return [[sum(r[p].uses - r[p].hits for p in PHASES) for r in res[l * E1:(l + 1) * E1]] for l in range(L)]


def _check_n_jobs(n_jobs) -> None:
    """n_jobs: workers (>= 1), or -1 for every core (joblib's convention)."""
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or not (n_jobs >= 1 or n_jobs == -1):
        raise ValueError(f"n_jobs={n_jobs!r}: give the number of workers (an int >= 1), or -1 for every core")


def _check_experts(trace, ex: Tensor, num_experts: int) -> None:
    """The num_experts a sweep or miss curves is given must be the trace's: its own count for a Trace, at least
    the largest id + 1 for an array."""
    if trace is not None and trace.num_experts != num_experts:
        raise ValueError(f"num_experts={num_experts} but the trace is of a model with {trace.num_experts} experts "
                         f"per layer: give num_experts={trace.num_experts}")
    top = int(ex.max()) if ex.numel() else -1
    if top >= num_experts:
        raise ValueError(f"num_experts={num_experts} but the trace routes to expert {top}: give the trace's expert "
                         f"count (at least {top + 1})")


def _bound(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise ValueError(f"{what} would start {n:,} layer replays, above max_replays={limit:,}; sample fewer "
                         f"budgets or layers, or raise max_replays if you mean it")


__all__ = ["predictions_from_rule", "replay", "replay_layer_pure", "sweep", "miss_curves", "trace_shape"]
