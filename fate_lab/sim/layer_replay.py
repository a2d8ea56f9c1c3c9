"""Running one layer's replay: the pure ExpertCache (any policy, the reference) or the compiled one (sim/fast/).

Every layer has its own slots, policy, predictions and staging pool, so a replay is a list of independent
(layer, slots) runs; `run_layers` runs them compiled where `fast_replay` covers the policy, else through the
runtime's own `ExpertCache` behind an instant link (`replay_layer`), in joblib workers when n_jobs > 1.
Split from replay.py, which turns configs and grids into these runs.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from torch import Tensor

from fate_lab.policy.cache import ExpertCache
from fate_lab.policy.registry import policy_from_name
from fate_lab.policy.replacement import ReplacementPolicy
from fate_lab.policy.stats import PHASES, PhaseStats
from fate_lab.sim.fast_replay import fast_supported, predicted_sets, replay_jobs_fast

PolicySpec = str | Callable[[int], ReplacementPolicy]
LayerStats = dict  # {"prefill": PhaseStats, "decode": PhaseStats} of one layer

class _Landed:
    """The instant mover of a one-layer replay: every transfer has landed when `submit` returns."""

    def __init__(self, cache_phase: Callable[[], str], stats: LayerStats):
        self.phase, self.stats = cache_phase, stats

    def submit(self, m, e, slot, urgent, reason):
        self.stats[self.phase()].bytes_moved += 1  # one expert; scaled to bytes at the end
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


def replay_layer_pure(uses: list[list[int]], phases: list[int], policy: PolicySpec, capacity: int, *,
                      policy_kw: dict | None = None, predictions: list | None = None, buffer: int = 0,
                      admit: str = "on_load") -> dict[str, int]:
    """One layer's uses through the pure ExpertCache, as the compiled replay's counts dict (its reference).

    ``uses[t]``: token t's experts in the router's order; ``predictions[t]``: its predicted set or None.
    """
    pol = make_policy(policy, capacity, uses, policy_kw or {})
    st = replay_layer(uses, predictions, phases, pol, buffer, len(uses[0]) if uses else 1, admit)
    p, d = st["prefill"], st["decode"]
    c = {"uses_prefill": p.uses, "hits_prefill": p.hits, "uses_decode": d.uses, "hits_decode": d.hits}
    for key, f in (("demand_loads", "misses"), ("prefetch_loads", "prefetch_issued"),
                   ("prefetch_useful", "prefetch_useful"), ("prefetch_wasted", "prefetch_wasted")):
        c[key] = getattr(p, f) + getattr(d, f)
        c[key + "_prefill"] = getattr(p, f)
    c["uses"], c["hits"] = p.uses + d.uses, p.hits + d.hits
    return c


def check_policy(policy) -> None:
    """One clear error for a policy spec that is neither a registered name nor a factory ``capacity -> policy``."""
    from fate_lab.policy.registry import POLICIES

    if isinstance(policy, str):
        if policy.lower() not in POLICIES:
            raise ValueError(f"unknown replacement policy {policy!r}; choose one of {sorted(POLICIES)}")
    elif not callable(policy):
        raise TypeError(f"policy={policy!r}: give a name, one of {sorted(POLICIES)}, or a factory "
                        "capacity -> ReplacementPolicy")


def make_policy(policy: PolicySpec, capacity: int, uses: list[list[int]], policy_kw: dict,
                num_experts: int | None = None) -> ReplacementPolicy:
    """The policy of one layer: a registered name (one that reads the future gets this layer's uses), or a factory."""
    if isinstance(policy, str):
        from fate_lab.policy.registry import policy_record

        if policy_record(policy).reads_future:
            return policy_from_name(policy, capacity, num_experts, future=uses)
        return policy_from_name(policy, capacity, num_experts, **policy_kw)
    return policy(capacity)


def replay_layer(uses: list[list[int]], preds: list | None, phases: list[int], pol: ReplacementPolicy,
                  buffer: int = 0, top_k: int = 1, admit_prefetch: str = "on_load",
                  probs: list[list[float]] | None = None) -> LayerStats:
    """Replay one layer's uses (``uses[t]`` = ids, in the router's order) through one ExpertCache; its counters
    per phase (bytes_moved counts experts moved)."""
    stats: LayerStats = {p: PhaseStats() for p in PHASES}
    cache: ExpertCache
    link = _Landed(lambda: cache.phase, stats)
    cache = ExpertCache([pol.capacity], lambda m, c: pol, max(1, top_k), buffer, link, [stats],
                        admit_on_use=admit_prefetch == "on_use")
    layer = cache.layers[0]
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
        for e in begin(0, list(dict.fromkeys(need))):
            acquire(0, e)
            done(0, e)
        cache.end(0)
    return stats


def run_layers(ex, uses, preds, phases, policy, kw, pairs, buffer, top_k, admit, n_jobs, fast) -> list[LayerStats]:
    """The LayerStats of layer l with s slots for every (l, s) of pairs: compiled where it covers the policy."""
    if isinstance(policy, str):
        from fate_lab.policy.registry import policy_record

        if policy_record(policy).needs_scores:
            raise ValueError(f"policy {policy!r} reads the router's probabilities, which sweep and miss_curves do not "
                             "compute: replay it with replay(trace, ...) on a Trace recorded with its gate inputs")
    if fast and fast_supported(policy, kw):
        return fast_layers(ex, preds, phases, policy, kw, pairs, buffer, admit, n_jobs)
    phases = [int(p) for p in phases]  # the uncompiled cache reads plain ints
    return _parallel(n_jobs, [(uses[l], None if preds is None else preds[l], phases, policy, s, kw, buffer, top_k,
                               admit) for l, s in pairs])


def fast_layers(ex: Tensor, preds, phases, policy: str, kw: dict, pairs, buffer: int, admit: str,
                n_jobs: int, probs=None, num_experts: int | None = None) -> list[LayerStats]:
    """The compiled replay's counts of every (layer, slots) pair, as the uncompiled replay's LayerStats (probs
    [N, L, E]: the router's probabilities, for a policy that reads them)."""
    L = ex.shape[1]
    sets = None if preds is None else predicted_sets([[preds[l][t] for l in range(L)] for t in range(ex.shape[0])], L)
    res = replay_jobs_fast(ex.cpu().numpy(), phases, policy=policy, layers=[l for l, _ in pairs],
                           capacities=[s for _, s in pairs], policy_kw=kw, predictions=sets, buffer=buffer,
                           admit=admit, n_jobs=n_jobs, probs=probs, num_experts=num_experts)
    n_pre = int((np.asarray(phases) == 0).sum())  # phases [N]: 0 prefill, 1 decode
    return [_layer_stats(r, n_pre, len(phases) - n_pre) for r in res]


def _layer_stats(c: dict, n_prefill: int, n_decode: int) -> LayerStats:
    """A fast-replay counts dict as per-phase PhaseStats (bytes_moved counts experts moved)."""
    out = {}
    for ph, calls, part in (("prefill", n_prefill, "_prefill"), ("decode", n_decode, None)):
        def v(key, part=part):  # noqa: E306
            return c[key + "_prefill"] if part else c[key] - c[key + "_prefill"]
        loads, demand = v("prefetch_loads"), v("demand_loads")
        out[ph] = PhaseStats(calls=calls, uses=c["uses_" + ph], hits=c["hits_" + ph], misses=demand,
                             prefetch_issued=loads, prefetch_useful=v("prefetch_useful"),
                             prefetch_wasted=v("prefetch_wasted"), bytes_moved=demand + loads)
    return out


def _one(uses, preds, phases, policy, capacity, kw, buffer, top_k, admit) -> LayerStats:
    return replay_layer(uses, preds, phases, make_policy(policy, capacity, uses, kw), buffer, top_k, admit)


def _parallel(n_jobs: int, jobs: list[tuple]) -> list[LayerStats]:
    """Layer replays in order, in n_jobs joblib workers (1: here, no processes)."""
    if n_jobs == 1 or len(jobs) < 2:
        return [_one(*j) for j in jobs]
    from joblib import Parallel, delayed

    return Parallel(n_jobs=n_jobs)(delayed(_one)(*j) for j in jobs)



__all__ = ["LayerStats", "PolicySpec", "fast_layers", "make_policy", "replay_layer", "replay_layer_pure", "run_layers"]
