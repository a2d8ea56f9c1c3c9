"""The compiled replay: the one cache's steps (`policy/cache_core.py`, `cache_steps.py`) compiled for one policy,
and the token loop that drives them behind an instant link.

What this file is: two pieces of text that `dispatch.py` puts together with the cache's own files, once per
registered policy, into one file that numba compiles and caches:
  1. the ``mode`` block: what the cache's interpreted mode block becomes in the compiled copy -- numba's `njit`,
     the policy's compiled functions bound to the names the cache calls (``POLICY`` is the one line `dispatch.py`
     changes per policy), typed lists, and mover functions that are never reached (the mover is None);
  2. the ``body``: `run_layer`, one layer's tokens through the cache's steps in the order `sim/layer_replay.py`'s
     `replay_layer` drives `ExpertCache` (tick, observe, prefetch the predicted set, begin, acquire and done per
     expert, end), and `run_jobs`, many (layer, capacity) replays in one call (``nogil``: `fast_replay` runs
     several such calls on threads).
The counts (``out``): uses and hits of prefill, uses and hits of decode, demand loads, prefetch loads, prefetched
experts used, prefetched experts not used (all phases), then the last four of prefill alone -- the cache's own
counters (`PhaseStats` fields), read from its compiled stats records.
What it is not: a second state machine. Read alone, this file is two fragments; it runs only inside the file
`dispatch.py` writes.
"""
from __future__ import annotations

# >>> mode: compiled (dispatch.py puts these lines in place of cache_core.py's interpreted mode block)
import dataclasses

import numpy as np
from numba import njit as _njit

from fate_lab.policy.kernels.record import F_ROWS, G_LEN, I_ROWS, R_LEN, S_LEN
from fate_lab.policy.registry import POLICIES
from fate_lab.policy.stats import PhaseStats


def njit(*args, **kw):
    """The cache's functions inlined into the token loop by LLVM (``forceinline``: its always-inline attribute) and
    compiled without reference counting (they allocate nothing). Called, a step passes the state's two dozen arrays
    by value (5 M look-ups/s on a cold trace where the inlined loop does 27 M), and with reference counting each of
    them is counted up and down atomically at every call (0.5 M). numba's own inlining (``inline="always"``) gives
    the same loop but copies a callee's IR at every one of its 141 (nested) inlinings: a policy's file compiled in
    30 s, against 16 s this way (`benchmarks/results/replay_public_2026-12-06_forceinline.md`)."""
    kw["_nrt"] = False
    kw.setdefault("forceinline", True)
    return _njit(*args, **kw) if args else (lambda f: _njit(f, **kw))


POLICY = POLICIES["lru"]
policy_init, policy_admit, policy_access = POLICY.init, POLICY.admit, POLICY.access
policy_observe, policy_tick = POLICY.observe, POLICY.tick


@njit(cache=True)
def pol_admit(P, E, e, prot):
    return policy_admit(P[0], P[1], P[2], P[3], P[4], E, e, prot)


@njit(cache=True)
def pol_access(P, E, e):
    policy_access(P[0], P[1], P[2], P[3], P[4], E, e)


def _unreached(*args):
    raise AssertionError("the compiled cache has no mover: its branches are pruned")


mv_submit = mv_poll = mv_cancel = mv_wait = mv_reload = _unreached
# <<< mode

from fate_lab.policy.cache_core import (  # noqa: E402 -- for a linter reading this file alone
    HASPRED,
    NEED_STEAL,
    Lay,
    Pools,
)
from fate_lab.policy.cache_steps import acquire, begin_a, begin_b, done, end, prefetch, prefetch_submit  # noqa: E402

# >>> body (dispatch.py copies what follows after the cache's steps)
N_COUNTS = 12
# the cache's counters: `PhaseStats`'s count fields (its times are the drivers' and stay out of a replay)
STATS = np.dtype([(f.name, np.int64) for f in dataclasses.fields(PhaseStats) if isinstance(f.default, int)])


@_njit(cache=True)
def new_state(E, cap, k, buffer, longest):
    """One layer with cap cache slots (0..cap-1), k demand slots and two prefetch pools of buffer slots after them
    (lists of E ids; a prediction of up to `longest`)."""
    rows = np.zeros((14, E), np.int64)
    rows[0] = rows[1] = rows[10] = -1  # where, staged, subst
    lists = np.zeros((6, max(E, longest) + 1), np.int64)
    L = Lay(rows[0], rows[1], rows[2], rows[3], rows[4], rows[5], rows[6], rows[7], rows[8], rows[9], rows[10],
            rows[11], rows[12], np.zeros(E + 8, np.uint8), lists[0], lists[1], lists[2], lists[3], lists[4], lists[5],
            np.arange(cap), np.array([0, 0, cap, 0, 0], np.int64))
    sizes = (k, buffer, buffer)
    pfree = np.zeros((3, max(k, buffer)), np.int64)
    pool_of = np.full(cap + k + 2 * buffer, -1, np.int64)
    base = cap
    for p in range(3):
        for i in range(sizes[p]):
            pfree[p, i] = base + i
            pool_of[base + i] = p
        base += sizes[p]
    z = np.zeros((2, k + 2 * buffer + 1), np.int64)
    return L, Pools(pfree, np.array([k, buffer, buffer], np.int64), pool_of, z[0], z[1])


@_njit(cache=True)
def run_layer(uses, phases, poff, pids, has_pred, prm, iprm, cap, E, buffer, on_use, nextuse, probs, out):
    """Replay uses [N, k] of one layer (predicted sets pids[poff[t]:poff[t+1]]; the router's probabilities probs
    [N, E] for a policy that reads them, else [0, 0]); counts into out [12]."""
    N, k = uses.shape
    W = E + 8
    P = (np.zeros((I_ROWS, W), np.int64), np.zeros((F_ROWS, W), np.float64), np.zeros(S_LEN, np.int64),
         np.zeros(G_LEN, np.float64), np.zeros(R_LEN, np.uint64))
    policy_init(P[0], P[1], P[2], P[3], P[4], E, cap, prm, iprm, uses)
    longest = 1
    if has_pred:
        for t in range(N):
            longest = max(longest, poff[t + 1] - poff[t])
    L, PZ = new_state(E, cap, k, buffer, longest)
    stats = np.zeros(2, STATS)
    scratch = np.empty((3, max(k, longest)), np.int64)
    replay_tokens(uses, phases, poff, pids, has_pred, P, E, on_use and cap > 0, nextuse, probs, L, PZ, stats,
                  scratch)
    pre, dec = stats[0], stats[1]
    out[0], out[1], out[2], out[3] = pre.uses, pre.hits, dec.uses, dec.hits
    out[4], out[5] = pre.misses + dec.misses, pre.prefetch_issued + dec.prefetch_issued
    out[6], out[7] = pre.prefetch_useful + dec.prefetch_useful, pre.prefetch_wasted + dec.prefetch_wasted
    out[8], out[9], out[10], out[11] = pre.misses, pre.prefetch_issued, pre.prefetch_useful, pre.prefetch_wasted


@_njit(cache=True, _nrt=False)
def replay_tokens(uses, phases, poff, pids, has_pred, P, E, promote_ok, nextuse, probs, L, PZ, stats, scratch):
    """The token loop of run_layer, in the order `layer_replay.replay_layer` drives `ExpertCache` (no allocation,
    so compiled without reference counting)."""
    N, k = uses.shape
    need, order, moves = scratch[0], scratch[1], scratch[2]
    cls = moves  # (free again once the token's prefetch is queued)
    for t in range(N):
        T = stats[phases[t]]
        policy_tick(P[0], P[1], P[2], P[3], P[4], E, t, uses, nextuse)
        if probs.shape[0]:
            policy_observe(P[0], P[1], P[2], P[3], P[4], E, probs[t], 1)
        if has_pred:
            a, b = poff[t], poff[t + 1]
            L.sc[HASPRED] = 1 if b > a else 0
            if b > a:
                L.pred[0] = b - a
                for j in range(a, b):
                    L.pred[1 + j - a] = pids[j]
                n_moves = prefetch(L, PZ, P, E, pids[a:b], -1, True, promote_ok, moves)
                prefetch_submit(L, T, None, 0, moves, n_moves, 0)
        n = 0  # the token's distinct experts, in the router's order
        for j in range(k):
            e = uses[t, j]
            seen = False
            for i in range(n):
                if need[i] == e:
                    seen = True
            if not seen:
                need[n] = e
                n += 1
        begin_a(L, PZ, T, P, E, None, need, n, None, cls)
        n_order = begin_b(L, PZ, T, P, E, None, 0, need, n, cls, None, order, True)
        for i in range(n_order):
            e = order[i]
            if acquire(L, PZ, T, P, E, None, 0, e, True, 0) == NEED_STEAL:
                raise RuntimeError("no slot for an expert in a one-layer replay (cache bug)")
            done(L, PZ, P, E, e, promote_ok)
        end(L)


@_njit(cache=True, nogil=True)
def run_jobs(uses, phases, poff, pids, has_pred, prm, iprm, layers, caps, E, buffer, on_use, nextuse, probs, out, jobs):
    """Replay job j = (layer layers[j], capacity caps[j]) for every j in jobs; counts into out [J, 12]. uses [N, L, k]
    as the caller holds it: each job reads its layer's column in place (no [L, N, k] copy). Without the GIL, so
    that threads replay disjoint jobs at once."""
    for j in jobs:
        l = layers[j]
        run_layer(uses[:, l], phases, poff[l], pids, has_pred, prm[j], iprm[j], caps[j], E, buffer, on_use, nextuse[l],
                  probs[l], out[j])
