"""Trace replay of the per-layer expert cache: hit rates, bytes moved, wasted prefetches.

Given a recorded routing trace ``experts [N, L, k]`` (tokens in processing order), a slot count
per layer, a replacement policy and optionally the predicted sets, ``replay`` drives THE
runtime's cache (``cache.ExpertCache``) with transfers that land at once, one token and one
layer at a time, in the runtime's order:

(a) prefetch: the experts predicted for layer l (made while layer l-1 ran) are queued most
    probable first, as the runtime queues them: admitted into the cache (``admit_prefetch=
    "on_load"``, protecting the rest of the predicted set) or held in one of
    ``prefetch_buffer`` staging slots until used (``"on_use"``; a used one then enters the
    cache); what finds no slot moves nothing;
(b) the token's experts of layer l are classified (resident or not) and computed in the
    runtime's order: hits first, then misses, each loaded on demand while the token's other
    experts of the layer are protected. That order is what the replacement policy sees, so an
    LRU result no longer depends on the column order of the input beyond the router's own order.

Layers are independent (each has its own slots, policy, predictions and staging pool), so
results are computed per (layer, slots) and ``sweep`` reuses them across the boundary x budget
grid. The replay has no clock: a prefetch always arrives. For time, the batched prefill step and
the link, use ``fate_lab.sim.simulate`` (same cache; equal counts with an instant link, tested).
Prefill tokens are replayed one by one, in trace order. ``replay``/``sweep``/``miss_curves``
accept a ``Trace`` or a plain ``[N, L, k]`` tensor, and ``slots_per_layer`` as a list or one int.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from fate_lab.offloading.stats import PHASES
from fate_lab.policy.allocation import ShallowFavoringAllocation
from fate_lab.policy.cache import ExpertCache
from fate_lab.policy.predictors import SelectionRule
from fate_lab.policy.replacement import ReplacementPolicy, policy_from_name

Predictions = list  # list[N] of list[L] of (list[int] | None)
PolicySpec = str | Callable[[int], ReplacementPolicy]

_COUNTS = ("uses", "hits", "uses_prefill", "hits_prefill", "uses_decode", "hits_decode",
           "demand_loads", "prefetch_loads", "prefetch_useful", "prefetch_wasted")


def predictions_from_rule(pred_scores: Tensor, rule: SelectionRule) -> Predictions:
    """Predicted ids per token and layer from cross-layer scores ``[N, L-1, E]``; ``out[t][0]`` is None."""
    N, Lm1, E = pred_scores.shape
    flat = rule.ids(pred_scores.reshape(N * Lm1, E))
    return [[None] + flat[t * Lm1 : (t + 1) * Lm1] for t in range(N)]


def _make_policy(policy: PolicySpec, capacity: int, uses: list[list[int]], policy_kw: dict) -> ReplacementPolicy:
    if isinstance(policy, str):
        if policy.lower() == "belady":
            return policy_from_name(policy, capacity, future=uses)
        return policy_from_name(policy, capacity, **policy_kw)
    return policy(capacity)


class _Landed:
    """The instant driver of the cache: every transfer has landed when `submit` returns."""

    def __init__(self):
        self.loads = [0, 0]  # (prefetch, demand) transfers

    def submit(self, m, e, slot, urgent, reason):
        self.loads[urgent] += 1
        return True

    def cancel(self, handle) -> bool:
        return False

    def poll(self, handle) -> bool:
        return True

    def wait(self, m, e, handle) -> bool:
        return True

    def reload(self, m, e, slot, reason) -> None:  # pragma: no cover - nothing fails here
        raise RuntimeError("an instant transfer cannot fail")

    def capacity(self, m):
        return None


def _replay_layer(
    uses: list[list[int]], preds: list | None, phases: list[int], pol: ReplacementPolicy, buffer: int = 0,
    top_k: int = 1, admit_prefetch: str = "on_load", probs: list[list[float]] | None = None,
) -> dict[str, int]:
    """Replay one layer's uses (``uses[t]`` = ids, in the router's order) through one ExpertCache."""
    link = _Landed()
    cap = pol.capacity
    cache = ExpertCache([cap], lambda m, c: pol, max(1, top_k), buffer, link, admit_on_use=admit_prefetch == "on_use")
    layer = cache.layers[0]
    stats = cache.stats[0]
    tick = getattr(pol, "at", None)
    begin, acquire, done, prefetch = cache.begin, cache.acquire, cache.done, cache.prefetch
    for t, need in enumerate(uses):
        if tick is not None:
            tick(t)
        cache.phase = PHASES[phases[t]]
        if probs is not None:
            pol.observe(probs[t], 1)
        if preds is not None and preds[t]:
            prefetch(0, preds[t])
        elif preds is not None:
            layer.prediction = None
        order = begin(0, list(dict.fromkeys(need)))
        for e in order:
            acquire(0, e)
            done(0, e)
        cache.end(0)
    p, d = stats["prefill"], stats["decode"]
    return {
        "uses": p.uses + d.uses, "hits": p.hits + d.hits,
        "uses_prefill": p.uses, "hits_prefill": p.hits, "uses_decode": d.uses, "hits_decode": d.hits,
        "demand_loads": link.loads[1], "prefetch_loads": link.loads[0],
        "prefetch_useful": p.prefetch_useful + d.prefetch_useful,
        "prefetch_wasted": p.prefetch_wasted + d.prefetch_wasted,
    }


def _rate(h: int, n: int) -> float | None:
    return h / n if n else None


def _summarise(c: dict[str, int], expert_bytes: int, has_phase: bool) -> dict:
    """Raw counts -> the reported metrics."""
    out = dict(c)
    out["misses"] = c["uses"] - c["hits"]
    out["hit_rate"] = _rate(c["hits"], c["uses"])
    out["hit_rate_prefill"] = _rate(c["hits_prefill"], c["uses_prefill"]) if has_phase else None
    out["hit_rate_decode"] = _rate(c["hits_decode"], c["uses_decode"]) if has_phase else None
    out["bytes_on_demand"] = c["demand_loads"] * expert_bytes
    out["bytes_prefetch"] = c["prefetch_loads"] * expert_bytes
    out["bytes_moved"] = out["bytes_on_demand"] + out["bytes_prefetch"]
    return out


@dataclass(frozen=True)
class ReplayResult:
    """Replay metrics: ``overall`` and ``per_layer`` dicts with hits, uses, misses, hit rates
    (all / prefill / decode; None without phase), bytes on demand / prefetch / moved,
    prefetch loads / useful / wasted (evicted before use) / unused at the end."""

    slots_per_layer: list[int]
    overall: dict
    per_layer: list[dict] = field(repr=False)

    @property
    def hit_rate(self) -> float | None:
        """Fraction of expert uses found resident."""
        return self.overall["hit_rate"]


def _prepare(experts, predictions: Predictions | None, phase):
    """(uses per layer, predictions per layer, phase per token, L, k, phase given?) from a Trace or a tensor."""
    from fate_lab.model.trace import Trace

    if isinstance(experts, Trace):
        phase = experts.phase if phase is None else phase
        experts = experts.experts
    ex = torch.as_tensor(experts)
    if ex.dim() != 3:
        raise ValueError(f"experts must be [N, L, k], got shape {tuple(ex.shape)}")
    if ex.is_floating_point():
        raise TypeError(f"expert ids must be integers, got dtype {ex.dtype}")
    N, L, k = ex.shape
    if isinstance(phase, str):
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r}: give 'prefill', 'decode', or one 0/1 per token")
        phase = torch.full((N,), PHASES.index(phase))
    rows = ex.tolist()
    uses = [[rows[t][l] for t in range(N)] for l in range(L)]
    preds = None
    if predictions is not None:
        if len(predictions) != N:
            raise ValueError(f"predictions has {len(predictions)} tokens, the trace {N}")
        preds = [[predictions[t][l] for t in range(N)] for l in range(L)]
    phases = [1] * N if phase is None else [int(p) for p in torch.as_tensor(phase).tolist()]
    if len(phases) != N or any(p not in (0, 1) for p in phases):
        raise ValueError(f"phase must hold one 0 (prefill) or 1 (decode) per token ({N} tokens)")
    return uses, preds, phases, L, k, phase is not None


def _router_probs(trace, L: int) -> list[list[list[float]]]:
    """Per layer, each token's router probabilities [N][E], from the trace's gate inputs and router weights
    (the product the runtime and the simulator compute), for policies that read the router."""
    from fate_lab.model.trace import Trace
    from fate_lab.policy.predictors import next_layer_scores

    if not isinstance(trace, Trace) or trace.gate_inputs is None or trace.router_weights is None:
        raise ValueError("this replacement policy reads the router's probabilities: replay a Trace recorded with "
                         "gate inputs and router weights (record_trace)")
    scoring = trace.meta.get("scoring", "softmax")
    gi = trace.gate_inputs.float()
    return [next_layer_scores(trace.router_weights[l].float(), gi[:, l], scoring).tolist() for l in range(L)]


def _slots(slots_per_layer, L: int) -> list[int]:
    if isinstance(slots_per_layer, int) and not isinstance(slots_per_layer, bool):
        slots_per_layer = [slots_per_layer] * L
    slots = list(slots_per_layer)
    if len(slots) != L:
        raise ValueError(f"slots_per_layer has {len(slots)} entries for {L} layers")
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in slots):
        raise ValueError(f"slots_per_layer must hold non-negative ints, got {slots}")
    return slots


def _combine(layer_counts: list[dict], slots: list[int], expert_bytes: int, has_phase: bool) -> ReplayResult:
    total = {k: sum(c[k] for c in layer_counts) for k in _COUNTS}
    per_layer = [dict(layer=l, slots=s, **_summarise(c, expert_bytes, has_phase))
                 for l, (c, s) in enumerate(zip(layer_counts, slots))]
    return ReplayResult(list(slots), _summarise(total, expert_bytes, has_phase), per_layer)


def replay(
    experts,
    *,
    slots_per_layer: Sequence[int] | int,
    policy: PolicySpec = "lru",
    predictions: Predictions | None = None,
    phase: Tensor | None = None,
    expert_bytes: int = 1,
    policy_kw: dict | None = None,
    prefetch_buffer: int = 0,
    admit_prefetch: str = "on_load",
) -> ReplayResult:
    """Replay a routing trace through per-layer caches (semantics in the module docstring).

    ``policy``: a name for ``policy_from_name`` ("belady" gets each layer's future) or a
    factory ``capacity -> ReplacementPolicy``. ``predictions[t][l]``: ids predicted for layer
    l of token t, or None (see ``predictions_from_rule`` / ``predictors.predict_trace``).
    ``prefetch_buffer``: staging slots per layer for predicted experts the cache cannot take
    (the runtime keeps ``top_k`` of them when it prefetches; 0 = the cache only).
    """
    uses, preds, phases, L, k, has_phase = _prepare(experts, predictions, phase)
    slots = _slots(slots_per_layer, L)
    kw = policy_kw or {}
    pols = [_make_policy(policy, s, uses[l], kw) for l, s in enumerate(slots)]
    probs = _router_probs(experts, L) if any(p.wants_scores for p in pols) else [None] * L
    counts = [
        _replay_layer(uses[l], None if preds is None else preds[l], phases, pols[l], prefetch_buffer, k,
                      admit_prefetch, probs[l])
        for l, s in enumerate(slots)
    ]
    return _combine(counts, slots, expert_bytes, has_phase)


def sweep(
    experts,
    *,
    boundaries: Sequence[int],
    budgets: Sequence[int],
    num_experts: int,
    policy: PolicySpec = "arc",
    predictions: Predictions | None = None,
    phase: Tensor | None = None,
    expert_bytes: int = 1,
    allocation: Callable[[int], object] = ShallowFavoringAllocation,
    policy_kw: dict | None = None,
    prefetch_buffer: int = 0,
    admit_prefetch: str = "on_load",
    n_jobs: int = 1,
) -> dict[str, list]:
    """Replay every (shallow boundary L, cache_total) pair; columns of a table (``pd.DataFrame(out)``).

    ``budgets`` are ``cache_total`` slot counts; ``allocation(L)`` builds the allocator (Fate's
    shallow-favoring one by default). Layer results are cached per (layer, slots), so the grid
    costs at most ``num_layers * (num_experts + 1)`` layer replays, which run in ``n_jobs`` processes
    (joblib; -1: every core; a cluster user can wrap the call in ``joblib.parallel_backend("ray")``).
    """
    uses, preds, phases, L, top_k, has_phase = _prepare(experts, predictions, phase)
    kw = policy_kw or {}
    pairs = sorted({(l, s) for b in boundaries for budget in budgets
                    for l, s in enumerate(allocation(b).allocate(budget, L, num_experts))})
    memo = dict(zip(pairs, _parallel(n_jobs, [
        (uses[l], None if preds is None else preds[l], phases, policy, s, kw, prefetch_buffer, top_k, admit_prefetch)
        for l, s in pairs])))
    cols: dict[str, list] = {k: [] for k in ("boundary", "cache_total", "slots", "hit_rate", "hit_rate_prefill",
                                             "hit_rate_decode", "misses", "bytes_moved", "prefetch_loads",
                                             "prefetch_wasted")}
    for b in boundaries:
        alloc = allocation(b)
        for budget in budgets:
            slots = alloc.allocate(budget, L, num_experts)
            counts = []
            for l, s in enumerate(slots):
                counts.append(memo[(l, s)])
            r = _combine(counts, slots, expert_bytes, has_phase).overall
            cols["boundary"].append(b)
            cols["cache_total"].append(budget)
            cols["slots"].append(slots)
            for k in list(cols)[3:]:
                cols[k].append(r[k])
    return cols


def miss_curves(
    experts,
    num_experts: int,
    *,
    policy: PolicySpec = "lru",
    predictions: Predictions | None = None,
    policy_kw: dict | None = None,
    prefetch_buffer: int = 0,
    admit_prefetch: str = "on_load",
    n_jobs: int = 1,
) -> list[list[int]]:
    """``curves[l][c]`` = misses of layer l with c slots (c = 0..E), prefetching included.

    Feed to ``allocation.MissCurveAllocation`` to allocate for the policy and predictor in use.
    The L x (E + 1) layer replays run in ``n_jobs`` processes (joblib; -1: every core).
    """
    uses, preds, phases, L, k, _ = _prepare(experts, predictions, None)
    kw = policy_kw or {}
    jobs = [(uses[l], None if preds is None else preds[l], phases, policy, c, kw, prefetch_buffer, k, admit_prefetch)
            for l in range(L) for c in range(num_experts + 1)]
    res = _parallel(n_jobs, jobs)
    return [[r["uses"] - r["hits"] for r in res[l * (num_experts + 1):(l + 1) * (num_experts + 1)]] for l in range(L)]


def _one(uses, preds, phases, policy, capacity, kw, buffer, top_k, admit) -> dict[str, int]:
    return _replay_layer(uses, preds, phases, _make_policy(policy, capacity, uses, kw), buffer, top_k, admit)


def _parallel(n_jobs: int, jobs: list[tuple]) -> list[dict]:
    """Layer replays in order, in n_jobs joblib workers (1: here, no processes)."""
    if n_jobs == 1 or len(jobs) < 2:
        return [_one(*j) for j in jobs]
    from joblib import Parallel, delayed

    return Parallel(n_jobs=n_jobs)(delayed(_one)(*j) for j in jobs)
