"""The fast replay: the per-layer cache replay of `replay.py`, compiled with numba, with identical counts.

What this file is: the Python face of `sim/fast/` -- array preparation, parameter checks, and three
calls: `replay_layer_fast` (one layer, one capacity), `replay_jobs_fast` (many (layer, capacity) pairs in
parallel; `replay.sweep` uses it) and `miss_curve_fast` (misses at every capacity 0..E of every layer;
`replay.miss_curves` uses it). `fast_supported` says when a policy spec is covered: a policy *name* of
`registry.POLICIES` with keywords the policy knows (a policy that reads the router's probabilities needs them as
``probs``). Not covered (the uncompiled replay runs them): policy factories (Python callables). The compiled
functions are cached on disk (numba ``cache=True``): the first replay of a policy on a machine compiles its loop
(3-14 s on a 2-core machine), later processes load it. ``n_jobs`` threads replay disjoint (layer, capacity) jobs at
once (the compiled loop releases the GIL).

Semantics: exactly the pure per-layer replay of `replay.py`, the one `cache.ExpertCache` driven with an instant
link (the parity tests in tests/sim/test_fast_replay.py require identical counts on random traces and on
both embedded models' traces). Predicted sets come as CSR arrays: ``offsets [N + 1]`` and ``ids``, token
t's set being ``ids[offsets[t]:offsets[t + 1]]`` (empty: no prefetch), or per layer for many layers.
What it is not: the definition of the cache (`policy/cache.py`) or of any policy (`policy/kernels/`: the replay
runs the very functions the runtime calls).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

COUNTS = ("uses_prefill", "hits_prefill", "uses_decode", "hits_decode", "demand_loads", "prefetch_loads",
          "prefetch_useful", "prefetch_wasted", "demand_loads_prefill", "prefetch_loads_prefill",
          "prefetch_useful_prefill", "prefetch_wasted_prefill")  # the order of the kernel's counters
ADMIT_MODES = ("on_load", "on_use")


@dataclass(frozen=True)
class PredictedSets:
    """Predicted experts per layer and token in CSR form: layer l, token t -> ids[offsets[l, t]:offsets[l, t + 1]]."""

    offsets: np.ndarray  # (L, N + 1) int64, absolute positions in ids
    ids: np.ndarray  # (nnz,) int32

    @property
    def num_layers(self) -> int:
        """L."""
        return self.offsets.shape[0]

    def layer_lists(self, l: int) -> list[list[int] | None]:
        """Layer l's sets as lists, one per token (None: no prediction), the pure replay's form."""
        o, ids = self.offsets[l], self.ids.tolist()
        return [ids[o[t]:o[t + 1]] or None for t in range(len(o) - 1)]


def predicted_sets(predictions, num_layers: int) -> PredictedSets:
    """CSR form of ``predictions[t][l]`` (ids or None, as `replay.replay` takes them)."""
    N = len(predictions)
    offsets = np.zeros((num_layers, N + 1), np.int64)
    ids: list[int] = []
    for l in range(num_layers):
        offsets[l, 0] = len(ids)
        for t in range(N):
            p = predictions[t][l]
            if p:
                ids.extend(int(e) for e in p)
            offsets[l, t + 1] = len(ids)
    return PredictedSets(offsets, np.asarray(ids, np.int32))


def fast_supported(policy, policy_kw: dict | None = None) -> bool:
    """True when the compiled replay covers this policy spec: a registered name, with keywords the policy knows."""
    from fate_lab.policy.registry import POLICIES

    if not isinstance(policy, str) or policy.lower() not in POLICIES:
        return False
    return set(policy_kw or {}) <= set(POLICIES[policy.lower()].keywords)


def _as_uses(uses, name: str = "uses") -> np.ndarray:
    a = np.asarray(uses)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer expert ids, got dtype {a.dtype}")
    if a.size and a.min() < 0:
        raise ValueError(f"{name} holds a negative expert id ({a.min()}); ids are 0..E-1")
    return a


def _phases(phases, N: int) -> np.ndarray:
    if phases is None:
        return np.ones(N, np.int8)
    p = np.asarray(phases).astype(np.int8).reshape(-1)
    if p.shape[0] != N or (p.size and (p.min() < 0 or p.max() > 1)):
        raise ValueError(f"phases must hold one 0 (prefill) or 1 (decode) per token ({N} tokens)")
    return p


def replay_jobs_fast(uses, phases=None, *, policy: str = "lru", layers: Sequence[int], capacities: Sequence[int],
                     policy_kw: dict | None = None, predictions: PredictedSets | None = None, buffer: int = 0,
                     admit: str = "on_load", num_experts: int | None = None, n_jobs: int = 1,
                     heap_above: int = 128, probs=None) -> list[dict[str, int]]:
    """Counts of layer ``layers[j]`` with ``capacities[j]`` slots for every j (uses [N, L, k]), in n_jobs threads.

    ``heap_above``: the key-ordered policies (LFU, LRFU, Belady, least-stale, LeCaR) keep their residents in
    a heap above this many slots, else in an array scanned on eviction (faster for small caches); the
    victims are the same (the tests run both).
    """
    from fate_lab.policy.compiled import next_uses_layers
    from fate_lab.policy.registry import policy_record
    from fate_lab.sim.fast.dispatch import loop_for

    rec = policy_record(policy) if isinstance(policy, str) else None
    if rec is None or not fast_supported(policy, policy_kw):
        raise ValueError(f"policy {policy!r} with keywords {sorted(policy_kw or {})} has no fast path: give a "
                         "registered name with its keywords (see fast_supported)")
    if admit not in ADMIT_MODES:
        raise ValueError(f"admit={admit!r}: choose one of {ADMIT_MODES}")
    if buffer < 0:
        raise ValueError(f"buffer must be >= 0 staging slots, got {buffer}")
    ex = _as_uses(uses)
    if ex.ndim != 3:
        raise ValueError(f"uses must be [N, L, k], got shape {ex.shape}")
    N, L, k = ex.shape
    layers = np.asarray(layers, np.int64)
    caps = np.asarray(capacities, np.int64)
    if layers.shape != caps.shape or (layers.size and (layers.min() < 0 or layers.max() >= L)):
        raise ValueError(f"layers and capacities must pair up, layers in 0..{L - 1}")
    if caps.size and caps.min() < 0:
        raise ValueError(f"capacities must be >= 0 slots, got {caps.min()}")
    E = int(max(ex.max(initial=-1), -1 if predictions is None else predictions.ids.max(initial=-1))) + 1
    if num_experts is not None:
        E = max(E, int(num_experts))
    E = max(E, 1)
    # read in place as [N, L, k] int32 (each layer's column strided: one compiled signature); another width or a
    # strided array is converted once, without the [L, N, k] transpose
    u = ex if ex.dtype == np.int32 and ex.flags.c_contiguous else np.ascontiguousarray(ex, np.int32)
    if predictions is None:  # never read without predictions (has_pred gates every offset)
        poff, pids, has_pred = np.zeros((L, 1), np.int64), np.zeros(1, np.int32), False
    else:
        if predictions.offsets.shape != (L, N + 1):
            raise ValueError(f"predictions cover {predictions.offsets.shape[0]} layers x "
                             f"{predictions.offsets.shape[1] - 1} tokens, the trace {L} x {N}")
        poff, has_pred = predictions.offsets.astype(np.int64), True
        pids = _as_uses(predictions.ids, "predictions").astype(np.int32)
    kw = dict(policy_kw or {})
    per_cap = {int(c): rec.params(int(c), kw, heap_above) for c in np.unique(caps)}
    prm = np.array([per_cap[int(c)][0] for c in caps], np.float64).reshape(len(caps), -1)
    iprm = np.array([per_cap[int(c)][1] for c in caps], np.int64).reshape(len(caps), -1)
    nxt = next_uses_layers(u) if rec.reads_future else np.zeros((L, 1, 1), np.int32)
    pr = np.zeros((L, 0, 0), np.float64)
    if rec.needs_scores:
        if probs is None:
            raise ValueError(f"policy {rec.name!r} reads the router's probabilities: give probs [N, L, E] (a Trace "
                             "recorded with gate inputs and router weights gives them)")
        pr = np.ascontiguousarray(np.asarray(probs, np.float64).transpose(1, 0, 2))
        if pr.shape[:2] != (L, N):
            raise ValueError(f"probs must be [N, L, E] = [{N}, {L}, E], got {np.asarray(probs).shape}")
        E = max(E, pr.shape[2])
    loop = loop_for(rec.name)
    out = np.zeros((len(caps), loop.N_COUNTS), np.int64)
    ph = _phases(phases, N)

    def run(jobs: np.ndarray) -> None:
        loop.run_jobs(u, ph, poff, pids, has_pred, prm, iprm, layers, caps, E, int(buffer), admit == "on_use", nxt,
                      pr, out, jobs)

    _on_threads(run, len(caps), n_jobs)
    return [_counts(row) for row in out]


def _counts(row: np.ndarray) -> dict[str, int]:
    c = dict(zip(COUNTS, (int(x) for x in row), strict=False))
    c["uses"] = c["uses_prefill"] + c["uses_decode"]
    c["hits"] = c["hits_prefill"] + c["hits_decode"]
    return c


def replay_layer_fast(uses, phases=None, *, policy: str = "lru", capacity: int, policy_kw: dict | None = None,
                      pred_offsets=None, pred_ids=None, buffer: int = 0, admit: str = "on_load",
                      num_experts: int | None = None, heap_above: int = 128) -> dict[str, int]:
    """Counts of one layer's uses [N, k] (ids in the router's order) with `capacity` slots, as `replay_layer_pure`."""
    ex = _as_uses(uses)
    if ex.ndim != 2:
        raise ValueError(f"uses must be [N, k], got shape {ex.shape}")
    preds = None
    if pred_offsets is not None:
        offs = np.asarray(pred_offsets, np.int64).reshape(1, -1)
        preds = PredictedSets(offs, np.asarray(pred_ids if pred_ids is not None else [], np.int32))
    return replay_jobs_fast(ex[:, None, :], phases, policy=policy, layers=[0], capacities=[capacity],
                            policy_kw=policy_kw, predictions=preds, buffer=buffer, admit=admit,
                            num_experts=num_experts, heap_above=heap_above)[0]


def miss_curve_fast(uses, num_experts: int, *, policy: str = "lru", policy_kw: dict | None = None,
                    predictions: PredictedSets | None = None, buffer: int = 0, admit: str = "on_load",
                    n_jobs: int = 1) -> list[list[int]]:
    """``curves[l][c]`` = misses of layer l with c slots, c = 0..num_experts (uses [N, L, k])."""
    L = np.asarray(uses).shape[1]
    layers = np.repeat(np.arange(L), num_experts + 1)
    caps = np.tile(np.arange(num_experts + 1), L)
    res = replay_jobs_fast(uses, None, policy=policy, layers=layers, capacities=caps, policy_kw=policy_kw,
                           predictions=predictions, buffer=buffer, admit=admit, num_experts=num_experts, n_jobs=n_jobs)
    E1 = num_experts + 1
    return [[r["uses"] - r["hits"] for r in res[l * E1:(l + 1) * E1]] for l in range(L)]


def _on_threads(run, n: int, n_jobs: int) -> None:
    """run(jobs) over the job indices 0..n-1, split round-robin over n_jobs threads (-1: one per core); the compiled
    loop releases the GIL, so the threads replay at once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    t = cores if n_jobs in (-1, None) else max(1, int(n_jobs))
    t = max(1, min(t, cores, n))
    if t == 1:
        run(np.arange(n, dtype=np.int64))
        return
    with ThreadPoolExecutor(t) as pool:
        for f in [pool.submit(run, np.arange(i, n, t, dtype=np.int64)) for i in range(t)]:
            f.result()
