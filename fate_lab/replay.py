"""Trace replay of the per-layer expert cache: hit rates, bytes moved, wasted prefetches.

Given a recorded routing trace ``experts [N, L, k]`` (tokens in processing order), a slot count
per layer, a replacement policy and optionally the predicted sets, ``replay`` walks the trace:
for each token and each layer in order

(a) prefetch: the experts predicted for this layer (made while the previous layer ran) are
    admitted, most probable first, protecting the rest of the predicted set (a prediction never
    evicts itself; what the cache cannot take goes to one of ``prefetch_buffer`` staging slots,
    resident for this token only, as in the runtime; beyond those it is skipped, moving nothing);
(b) each true expert is a *hit* if resident (prefetched in time or cached), else a *miss*,
    loaded on demand and admitted while protecting the token's other experts of this layer.

Layers are independent (each has its own slots, policy and predictions), so results are
computed per (layer, slots) and ``sweep`` reuses them across the boundary x budget grid.
The replay is a model of the runtime's cache, not a timing model: no stalls are computed here.
Prefill tokens are replayed one by one, in trace order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from fate_lab.allocation import ShallowFavoringAllocation
from fate_lab.predictors import SelectionRule
from fate_lab.replacement import ReplacementPolicy, policy_from_name

Predictions = list  # list[N] of list[L] of (list[int] | None)
PolicySpec = str | Callable[[int], ReplacementPolicy]

_COUNTS = ("uses", "hits", "uses_prefill", "hits_prefill", "uses_decode", "hits_decode",
           "demand_loads", "prefetch_loads", "prefetch_useful", "prefetch_wasted", "prefetch_unused_at_end")


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


def _replay_layer(
    uses: list[list[int]], preds: list | None, phases: list[int], pol: ReplacementPolicy, buffer: int = 0
) -> dict[str, int]:
    """Replay one layer's uses (``uses[t]`` = ids) through ``pol``; returns the raw counts.

    ``buffer``: staging slots for prefetched experts that the cache could not take; they are
    resident for this token's use only (the runtime's prefetch buffers), then dropped.
    """
    hits, n = [0, 0], [0, 0]
    demand = pf_loads = pf_useful = pf_wasted = 0
    pending: set[int] = set()  # prefetched, not yet used
    admit, access = pol.admit, pol.access
    tick = getattr(pol, "at", None)
    for t, need in enumerate(uses):
        if tick is not None:
            tick(t)
        staged: set[int] = set()
        if preds is not None:
            p = preds[t]
            if p:
                prot = frozenset(p)
                for e in p:
                    if e in pol:
                        continue
                    v = admit(e, prot)
                    if v == e:  # did not fit the cache: a staging slot, if one is free, else nothing moves
                        if len(staged) < buffer:
                            staged.add(e)
                            pf_loads += 1
                        continue
                    pf_loads += 1
                    pending.add(e)
                    if v is not None and v in pending:
                        pending.discard(v)
                        pf_wasted += 1
        ph = phases[t]
        prot = frozenset(need)
        for e in need:
            n[ph] += 1
            if e in staged:  # prefetched into a staging slot in time
                hits[ph] += 1
                pf_useful += 1
                staged.discard(e)
            elif e in pol:
                hits[ph] += 1
                access(e)
                if e in pending:
                    pending.discard(e)
                    pf_useful += 1
            else:
                demand += 1
                v = admit(e, prot)
                if v is not None and v != e and v in pending:
                    pending.discard(v)
                    pf_wasted += 1
        pf_wasted += len(staged)  # staged but not used by this token
    return {
        "uses": n[0] + n[1], "hits": hits[0] + hits[1],
        "uses_prefill": n[0], "hits_prefill": hits[0], "uses_decode": n[1], "hits_decode": hits[1],
        "demand_loads": demand, "prefetch_loads": pf_loads, "prefetch_useful": pf_useful,
        "prefetch_wasted": pf_wasted, "prefetch_unused_at_end": len(pending),
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


def _prepare(experts: Tensor, predictions: Predictions | None, phase: Tensor | None):
    ex = torch.as_tensor(experts)
    if ex.dim() != 3:
        raise ValueError(f"experts must be [N, L, k], got shape {tuple(ex.shape)}")
    N, L, _ = ex.shape
    rows = ex.tolist()
    uses = [[rows[t][l] for t in range(N)] for l in range(L)]
    preds = None
    if predictions is not None:
        if len(predictions) != N:
            raise ValueError(f"predictions has {len(predictions)} tokens, the trace {N}")
        preds = [[predictions[t][l] for t in range(N)] for l in range(L)]
    phases = [1] * N if phase is None else [int(p) for p in torch.as_tensor(phase).tolist()]
    return uses, preds, phases, L


def _combine(layer_counts: list[dict], slots: list[int], expert_bytes: int, has_phase: bool) -> ReplayResult:
    total = {k: sum(c[k] for c in layer_counts) for k in _COUNTS}
    per_layer = [dict(layer=l, slots=s, **_summarise(c, expert_bytes, has_phase))
                 for l, (c, s) in enumerate(zip(layer_counts, slots))]
    return ReplayResult(list(slots), _summarise(total, expert_bytes, has_phase), per_layer)


def replay(
    experts: Tensor,
    *,
    slots_per_layer: Sequence[int],
    policy: PolicySpec = "lru",
    predictions: Predictions | None = None,
    phase: Tensor | None = None,
    expert_bytes: int = 1,
    policy_kw: dict | None = None,
    prefetch_buffer: int = 0,
) -> ReplayResult:
    """Replay a routing trace through per-layer caches (semantics in the module docstring).

    ``policy``: a name for ``policy_from_name`` ("belady" gets each layer's future) or a
    factory ``capacity -> ReplacementPolicy``. ``predictions[t][l]``: ids predicted for layer
    l of token t, or None (see ``predictions_from_rule`` / ``predictors.predict_trace``).
    ``prefetch_buffer``: staging slots per layer for predicted experts the cache cannot take
    (the runtime keeps ``top_k`` of them when it prefetches; 0 = the cache only).
    """
    uses, preds, phases, L = _prepare(experts, predictions, phase)
    if len(slots_per_layer) != L:
        raise ValueError(f"slots_per_layer has {len(slots_per_layer)} entries for {L} layers")
    kw = policy_kw or {}
    counts = [
        _replay_layer(uses[l], None if preds is None else preds[l], phases, _make_policy(policy, s, uses[l], kw),
                      prefetch_buffer)
        for l, s in enumerate(slots_per_layer)
    ]
    return _combine(counts, list(slots_per_layer), expert_bytes, phase is not None)


def sweep(
    experts: Tensor,
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
) -> dict[str, list]:
    """Replay every (shallow boundary L, cache_total) pair; columns of a table (``pd.DataFrame(out)``).

    ``budgets`` are ``cache_total`` slot counts; ``allocation(L)`` builds the allocator (Fate's
    shallow-favoring one by default). Layer results are cached per (layer, slots), so the grid
    costs at most ``num_layers * (num_experts + 1)`` layer replays.
    """
    uses, preds, phases, L = _prepare(experts, predictions, phase)
    kw = policy_kw or {}
    memo: dict[tuple[int, int], dict] = {}
    cols: dict[str, list] = {k: [] for k in ("boundary", "cache_total", "slots", "hit_rate", "hit_rate_prefill",
                                             "hit_rate_decode", "misses", "bytes_moved", "prefetch_loads",
                                             "prefetch_wasted")}
    for b in boundaries:
        alloc = allocation(b)
        for budget in budgets:
            slots = alloc.allocate(budget, L, num_experts)
            counts = []
            for l, s in enumerate(slots):
                if (l, s) not in memo:
                    pol = _make_policy(policy, s, uses[l], kw)
                    memo[(l, s)] = _replay_layer(uses[l], None if preds is None else preds[l], phases, pol,
                                                 prefetch_buffer)
                counts.append(memo[(l, s)])
            r = _combine(counts, slots, expert_bytes, phase is not None).overall
            cols["boundary"].append(b)
            cols["cache_total"].append(budget)
            cols["slots"].append(slots)
            for k in list(cols)[3:]:
                cols[k].append(r[k])
    return cols


def miss_curves(
    experts: Tensor,
    num_experts: int,
    *,
    policy: PolicySpec = "lru",
    predictions: Predictions | None = None,
    policy_kw: dict | None = None,
    prefetch_buffer: int = 0,
) -> list[list[int]]:
    """``curves[l][c]`` = misses of layer l with c slots (c = 0..E), prefetching included.

    Feed to ``allocation.MissCurveAllocation`` to allocate for the policy and predictor in use.
    """
    uses, preds, phases, L = _prepare(experts, predictions, None)
    kw = policy_kw or {}
    curves = []
    for l in range(L):
        curve = []
        for c in range(num_experts + 1):
            r = _replay_layer(uses[l], None if preds is None else preds[l], phases, _make_policy(policy, c, uses[l], kw),
                              prefetch_buffer)
            curve.append(r["uses"] - r["hits"])
        curves.append(curve)
    return curves
