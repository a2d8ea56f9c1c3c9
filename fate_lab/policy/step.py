"""The layer step: one MoE layer's experts call, the same code for the runtime, the simulator and the replay.

What this file is: `needed_order` (which experts a call needs, in the order they compute), the two small
records a driver hands over -- `StepRules` (what stays fixed over a run: predictor, router, popularity
order, lossy miss rule, Fate's INT2 prefill tail) and `LayerCall` (one call: the layer, its routing, its
gate input, how an expert computes) -- and `run_layer`, the sequence Fate's pipeline runs in every MoE
layer m:
  1. the cache settles finished transfers, drops stale prefetches and queues the misses (urgent);
  2. the predictor scores layer m+1 on the host from layer m's gate input (and, at depth 2 in decode,
     layer m+2 from the same input) and the cache queues the predicted experts (most probable first, as
     many as the link can start in time when the config says so; by value in the value cache);
  3. layer m's experts compute one after another from their slots, waiting where a transfer
     is still on the link.
What differs between drivers is only `LayerCall.target` (how an expert computes: real expert math, or simulated
time), to which `dispatch` -- the one compute dispatch of every driver -- sends each expert by the slot the cache
gave it (a device slot, `cache.HOST` for the host, `lossy.LOWP` for the resident INT2 stand-in), and
`LayerCall.timed` (how the host-side prediction's time is accounted).
What it is not: it keeps no state, moves no bytes, and knows no clock.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from torch import Tensor

from fate_lab.policy.cache import HOST, ExpertCache
from fate_lab.policy.lossy import LOWP, MissPolicy
from fate_lab.policy.predictors import Predictor
from fate_lab.policy.rules import RouterScores


@dataclass(frozen=True)
class StepRules:
    """What a driver's layer steps share for a whole run."""

    predictor: Predictor | None  # None: no prefetching
    router: RouterScores | None  # every MoE layer's router on the host (None: a routing-only trace)
    popularity: bool = True  # prefill computes popular experts first
    miss_policy: MissPolicy | None = None  # lossy decode steps (None: every expert computes as routed)
    prefill_low_count: Callable[[int], int] | None = None  # of k prefill prefetches, how many travel at INT2
    depth: int = 1  # 2: decode steps also predict layer m+2 from layer m's gate input (the value cache plans it)


class ComputeTarget(Protocol):
    """How a driver computes expert e of the call, in each of the three places the cache can hand it."""

    def on_device(self, e: int, slot: int) -> None:
        """From device slot `slot`."""

    def on_host(self, e: int) -> None:
        """On the host, from the store's weights."""

    def from_standin(self, e: int) -> None:
        """From its resident low-precision copy (a lossy stand-in)."""


def dispatch(target: ComputeTarget, e: int, slot: int) -> None:
    """Expert e computes where the cache put it: `cache.HOST` on the host, `lossy.LOWP` from its stand-in, else its
    device slot (the one dispatch the runtime and the simulator share)."""
    if slot == HOST:
        target.on_host(e)
    elif slot == LOWP:
        target.from_standin(e)
    else:
        target.on_device(e, slot)


@dataclass
class LayerCall:
    """One experts call of MoE layer m, as a driver hands it to `run_layer`."""

    m: int
    routing: Tensor  # (T, K) expert ids, on the host
    target: ComputeTarget  # how an expert computes (real expert math, or simulated time); `dispatch` picks where
    gate_input: Tensor | None = None  # (T, H) layer m's gate input (None: a routing-only trace)
    weights: Tensor | None = None  # (T, K) top-k gate weights on the host (lossy rules only)
    timed: Callable[[Callable[[], Any]], Any] | None = None  # runs the host-side prediction, accounts its time


def needed_order(flat: list[int], popularity: bool) -> list[int]:
    """Distinct experts of a call's flat (token, k) ids: by popularity (count, then first use), or by id."""
    if not popularity:
        return sorted(set(flat))
    count = Counter(flat)
    first = {}
    for i, e in enumerate(flat):
        first.setdefault(e, i)
    return sorted(count, key=lambda e: (-count[e], first[e]))


def _own_scores(rules: StepRules, call: LayerCall, why: str) -> Tensor:
    """Layer m's own router probabilities [T, E] (a score-reading replacement policy, the commit rule)."""
    if rules.router is None or call.gate_input is None:
        raise ValueError(f"{why} needs the router's probabilities; this driver gives none (a routing-only trace?)")
    return rules.router.scores(call.m, call.gate_input)


def _miss_plan(rules: StepRules, call: LayerCall, flat: list[int]):
    """The lossy rule's plan for a decode token's misses: {missing expert: stand-in or None}."""
    mp, m = rules.miss_policy, call.m
    w = call.weights.reshape(-1).tolist()  # (K,) gate weights of the token's experts, in flat's order
    total = sum(w) or 1.0
    share: dict[int, float] = {}
    for e, wi in zip(flat, w, strict=False):
        share[e] = share.get(e, 0.0) + wi / total
    mass = None
    if mp.kind == "commit":
        mass = float(_own_scores(rules, call, "the commit policy")[0].topk(len(flat)).values.sum())  # router top-k mass
    return lambda missing, resident: mp.plan(m, missing, share, resident, mass)


def run_layer(cache: ExpertCache, rules: StepRules, call: LayerCall) -> list[int]:
    """One experts call (semantics in the module docstring); returns the compute order (dropped experts are
    missing from it: the caller renormalises)."""
    m, idx = call.m, call.routing
    flat = idx.reshape(-1).tolist()  # (T*K,)
    policy = cache.layers[m].policy
    if policy.wants_scores:
        p = _own_scores(rules, call, f"replacement policy {policy.name!r}")  # (T, E)
        policy.observe(p.mean(dim=0).tolist(), p.shape[0])
    counts = Counter(flat) if cache.placement is not None else None
    miss_plan = None
    if rules.miss_policy is not None and idx.shape[0] == 1 and cache.phase == "decode":
        miss_plan = _miss_plan(rules, call, flat)
    order = cache.begin(m, needed_order(flat, rules.popularity), counts, miss_plan)
    predictor = rules.predictor
    if predictor is not None and m + 1 < len(cache.layers):
        def predict() -> list[int]:
            s = None if call.gate_input is None or rules.router is None else \
                predictor.scores(m, call.gate_input, rules.router)  # (T, E) what it reads for layer m+1
            cur = idx[0] if idx.shape[0] == 1 else idx
            return list(predictor.predict(m, None if s is None else (s[0] if s.shape[0] == 1 else s), cur))

        predicted = call.timed(predict) if call.timed is not None else predict()
        targets = [(m + 1, predicted)]
        if rules.depth > 1 and m + 2 < len(cache.layers) and cache.phase == "decode" and idx.shape[0] == 1:
            def predict_far() -> list[int] | None:  # layer m+2's router on layer m's gate input
                if call.gate_input is None or rules.router is None:
                    return None
                return predictor.predict_ahead(m, call.gate_input, rules.router, 2)

            far = call.timed(predict_far) if call.timed is not None else predict_far()
            if far is not None:
                targets.append((m + 2, far))
        low = rules.prefill_low_count if cache.phase == "prefill" else None
        cache.prefetch_ahead(m, targets, low)
    if predictor is not None:
        predictor.observe(m, idx)
    for e in order:
        slot = cache.acquire(m, e)
        dispatch(call.target, e, slot)
        cache.done(m, e)
    cache.end(m)
    return order
