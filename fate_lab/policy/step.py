"""The layer step: one MoE layer's experts call, the same code for the runtime and the simulator.

What this file is: `needed_order` (which experts a call needs, in the order they compute) and
`run_layer`, the sequence Fate's decode pipeline runs in every MoE layer m:
  1. the cache settles finished transfers, drops stale prefetches and queues the misses (urgent);
  2. the predictor scores layer m+1 on the host from layer m's gate input and the cache queues
     the predicted experts (most probable first, as many as the link can start in time when
     the config says so);
  3. layer m's experts compute one after another from their slots, waiting where a transfer
     is still on the link.
The caller supplies what differs: `scores()` (the cross-layer scores, computed on the host),
`compute(e, slot)` (real expert math in the runtime, simulated time in the simulator; slot is
`cache.HOST` for an expert the placement computes on the host) and
`on_predict(seconds)` hooks. What it is not: it keeps no state, moves no bytes, and knows no clock.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from torch import Tensor

from fate_lab.policy.cache import ExpertCache
from fate_lab.policy.lossy import MissPolicy
from fate_lab.policy.predictors import Predictor


def needed_order(flat: list[int], popularity: bool) -> list[int]:
    """Distinct experts of a call's flat (token, k) ids: by popularity (count, then first use), or by id."""
    if not popularity:
        return sorted(set(flat))
    count = Counter(flat)
    first = {}
    for i, e in enumerate(flat):
        first.setdefault(e, i)
    return sorted(count, key=lambda e: (-count[e], first[e]))


def run_layer(cache: ExpertCache, predictor: Predictor | None, m: int, idx_host: Tensor,
              scores: Callable[[], Tensor | None], compute: Callable[[int, int], None],
              popularity: bool = True, low_count: Callable[[int], int] | None = None,
              timed_predict: Callable[[Callable[[], list[int]]], list[int]] | None = None,
              router_scores: Callable[[], Tensor] | None = None, miss_policy: MissPolicy | None = None,
              weights: Tensor | None = None) -> list[int]:
    """One experts call of MoE layer m with routing idx_host [T, K]; returns the compute order.

    `router_scores()` gives layer m's own router probabilities [T, E], asked only when its
    replacement policy wants them (`ReplacementPolicy.wants_scores`) or the commit rule needs them.
    `miss_policy` (lossy decode steps) reads the token's top-k gate `weights` [1, K]; experts it
    drops are missing from the returned order (the caller renormalises).

    `timed_predict(fn)` runs the host-side prediction `fn` and accounts for its time (runtime:
    a timeline event; simulator: the host profile's predictor time); None just calls it.
    """
    flat = idx_host.reshape(-1).tolist()  # (T*K,)
    policy = cache.layers[m].policy
    if policy.wants_scores:
        if router_scores is None:
            raise ValueError(f"replacement policy {policy.name!r} needs the router's probabilities; this driver "
                             "gives none (a routing-only trace?)")
        p = router_scores()  # (T, E)
        policy.observe(p.mean(dim=0).tolist(), p.shape[0])
    counts = Counter(flat) if cache.placement is not None else None
    miss_plan = None
    if miss_policy is not None and idx_host.shape[0] == 1 and cache.phase == "decode":
        w = weights.reshape(-1).tolist()  # (K,) gate weights of the token's experts, in flat's order
        total = sum(w) or 1.0
        share: dict[int, float] = {}
        for e, wi in zip(flat, w):
            share[e] = share.get(e, 0.0) + wi / total
        mass = None
        if miss_policy.kind == "commit":
            if router_scores is None:
                raise ValueError("the commit policy needs the router's probabilities; this driver gives none")
            mass = float(router_scores()[0].topk(len(flat)).values.sum())  # router mass on its top-k
        miss_plan = lambda missing, resident: miss_policy.plan(m, missing, share, resident, mass)  # noqa: E731
    order = cache.begin(m, needed_order(flat, popularity), counts, miss_plan)
    if predictor is not None and m + 1 < len(cache.layers):
        def predict() -> list[int]:
            s = scores()  # (T, E) layer m+1's router on layer m's gate input
            cur = idx_host[0] if idx_host.shape[0] == 1 else idx_host
            return list(predictor.predict(m, None if s is None else (s[0] if s.shape[0] == 1 else s), cur))

        predicted = timed_predict(predict) if timed_predict is not None else predict()
        cache.prefetch(m + 1, predicted, low_count)
    if predictor is not None:
        predictor.observe(m, idx_host)
    for e in order:
        slot = cache.acquire(m, e)
        compute(e, slot)
        cache.done(m, e)
    cache.end(m)
    return order
