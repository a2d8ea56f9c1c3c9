"""The compiled replay driver: one layer's tokens through one policy, exactly as `ExpertCache` with an instant link.

What this file is: `run_layer`, the per-layer replay loop in numba, and `run_jobs`, many (layer, capacity)
replays in one call (``nogil``: `fast_replay` runs several such calls on threads). `run_layer` reproduces what
`sim/replay.py`'s `_replay_layer` makes the one cache do, in the same order of policy calls (the parity tests
require identical counts):
  1. prefetch (a predicted set for this token): each predicted expert not yet resident is admitted
     into the cache protecting the whole set ("on_load"), or held in one of ``buffer`` staging slots
     ("on_use"); "on_load" stages what the cache refuses; the first expert that finds no slot ends it.
     An expert admitted twice in one set is reserved once more (a use, and one more transfer).
  2. the token's distinct experts, in the router's order: staged or cached ones are hits (cached:
     ``access``), the rest misses, each admitted protecting the whole token (refused: staged);
  3. the experts compute, hits first: a staged one is released, or ("on_use") admitted protecting the
     experts not computed yet.
Counts (``out``): uses and hits of prefill, uses and hits of decode, demand loads, prefetch loads,
prefetched experts used, prefetched experts not used (all phases), then the last four of prefill alone (each
counted in the phase of the token that caused it, as the pure cache counts them).

One policy per copy: the loop calls the functions of ``POLICY`` below. This file is the copy for LRU; `dispatch.py`
writes out one copy of this very text per registered policy, only the ``POLICY`` line changed, and imports it. The
two calls of every token, the use of a cached expert and the admit of a missed one, are the policy's functions
inlined (``*_inline``); the rarer ones (prefetch, admit on use) are compiled calls. Inlining at those two sites
made ARC, LFU and LIRS 20-37% faster than calling there, and compiling all twelve loops from a cold cache took
82 s against 62-65 s (inlining admit at all three of its sites cost 2-6x the compile time of a call); one loop
branching over every policy, before, compiled in 91 s and ran LRU at half the speed. Each loop compiles the first
time its policy is replayed (3-14 s on the 2-core test machine), one-off measurements on that machine.
What it is not: the semantics -- that is `cache.ExpertCache`; this is its replay, pinned by tests.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from fate_lab.policy.kernels.record import F_ROWS, G_LEN, I_ROWS, R_LEN, S_LEN
from fate_lab.policy.registry import POLICIES

POLICY = POLICIES["lru"]
policy_init, policy_admit, policy_access = POLICY.init, POLICY.admit, POLICY.access
policy_observe, policy_tick = POLICY.observe, POLICY.tick
policy_admit_inline = njit(cache=True, _nrt=False, inline="always")(POLICY.admit.py_func)
policy_access_inline = njit(cache=True, _nrt=False, inline="always")(POLICY.access.py_func)

N_COUNTS = 12


@njit(cache=True)
def run_layer(uses, phases, poff, pids, has_pred, prm, iprm, cap, E, buffer, on_use, nextuse, probs, out):
    """Replay uses [N, k] of one layer (predicted sets pids[poff[t]:poff[t+1]]; the router's probabilities probs
    [N, E] for a policy that reads them, else [0, 0]); counts into out [12]."""
    W = E + 8
    I = np.zeros((I_ROWS, W), np.int64)
    F = np.zeros((F_ROWS, W), np.float64)
    S = np.zeros(S_LEN, np.int64)
    G = np.zeros(G_LEN, np.float64)
    R = np.zeros(R_LEN, np.uint64)
    policy_init(I, F, S, G, R, E, cap, prm, iprm, uses)
    flags = np.zeros((6, E), np.uint8)
    lists = np.empty((5, max(E, uses.shape[1])), np.int64)
    replay_loop(uses, phases, poff, pids, has_pred, cap, E, buffer, on_use, nextuse, probs, out, I, F, S, G, R, flags,
                lists)


@njit(cache=True, _nrt=False)
def replay_loop(uses, phases, poff, pids, has_pred, cap, E, buffer, on_use, nextuse, probs, out, I, F, S, G, R,
                flags, lists):
    """The token loop of run_layer (no allocation, so compiled without reference counting)."""
    N, k = uses.shape
    res = flags[0]  # cached
    staged = flags[1]  # in a staging slot
    pend = flags[2]  # needed by the token, not computed yet (the protect set)
    inpred = flags[3]  # in this token's predicted set (the prefetch's protect set)
    pf = flags[4]  # moved by this token's prefetch
    rnd = flags[5]  # admitted by this token's prefetch
    need, order, miss, moved, stg = lists[0], lists[1], lists[2], lists[3], lists[4]
    uses0 = hits0 = uses1 = hits1 = demand = loads = useful = wasted = 0  # the counters, kept in registers
    d0 = l0 = u0 = w0 = 0  # ... of prefill tokens alone
    for t in range(N):
        ph = phases[t]
        snap_d, snap_l, snap_u, snap_w = demand, loads, useful, wasted
        policy_tick(I, F, S, G, R, E, t, uses, nextuse)
        if probs.shape[0]:
            policy_observe(I, F, S, G, R, E, probs[t], 1)
        nm = 0  # distinct experts moved by the prefetch
        ns = 0  # ... of them staged
        if has_pred and poff[t + 1] > poff[t]:
            a, b = poff[t], poff[t + 1]
            if not on_use:
                for j in range(a, b):
                    inpred[pids[j]] = 1
            pool = buffer
            for j in range(a, b):
                e = pids[j]
                if staged[e]:
                    continue
                if res[e]:
                    if rnd[e]:  # reserved earlier in this set: reserved again
                        policy_access(I, F, S, G, R, E, e)
                        loads += 1
                    continue
                if cap > 0 and not on_use:
                    v = policy_admit(I, F, S, G, R, E, e, inpred)
                    if v != e:
                        if v >= 0:
                            res[v] = 0
                        res[e] = 1
                        rnd[e] = 1
                        if not pf[e]:
                            pf[e] = 1
                            moved[nm] = e
                            nm += 1
                        loads += 1
                        continue
                if pool == 0:
                    break
                pool -= 1
                staged[e] = 1
                stg[ns] = e
                ns += 1
                if not pf[e]:
                    pf[e] = 1
                    moved[nm] = e
                    nm += 1
                loads += 1
            for j in range(a, b):
                inpred[pids[j]] = 0
        n = 0
        for j in range(k):
            e = uses[t, j]
            if not pend[e]:
                pend[e] = 1
                need[n] = e
                n += 1
        used = 0
        for i in range(nm):
            e = moved[i]
            used += pend[e]
            pf[e] = 0
            rnd[e] = 0
        useful += used
        wasted += nm - used
        for i in range(ns):  # staged experts this token does not need leave
            if not pend[stg[i]]:
                staged[stg[i]] = 0
        nh = 0  # hits first, then the misses, each in the router's order
        nmiss = 0
        for i in range(n):
            e = need[i]
            if staged[e] or res[e]:
                order[nh] = e
                nh += 1
                if res[e]:
                    policy_access_inline(I, F, S, G, R, E, e)
            else:
                miss[nmiss] = e
                nmiss += 1
        if ph:
            uses1 += n
            hits1 += nh
        else:
            uses0 += n
            hits0 += nh
        demand += nmiss
        for i in range(nmiss):
            e = miss[i]
            order[nh + i] = e
            if cap > 0:
                v = policy_admit_inline(I, F, S, G, R, E, e, pend)
                if v != e:
                    if v >= 0:
                        res[v] = 0
                    res[e] = 1
                    continue
            staged[e] = 1
        for i in range(n):
            e = order[i]
            pend[e] = 0
            if staged[e]:
                staged[e] = 0
                if on_use and cap > 0:
                    v = policy_admit(I, F, S, G, R, E, e, pend)
                    if v != e:
                        if v >= 0:
                            res[v] = 0
                        res[e] = 1
        if not ph:
            d0 += demand - snap_d
            l0 += loads - snap_l
            u0 += useful - snap_u
            w0 += wasted - snap_w
    out[0], out[1], out[2], out[3] = uses0, hits0, uses1, hits1
    out[4], out[5], out[6], out[7] = demand, loads, useful, wasted
    out[8], out[9], out[10], out[11] = d0, l0, u0, w0


@njit(cache=True, nogil=True)
def run_jobs(uses, phases, poff, pids, has_pred, prm, iprm, layers, caps, E, buffer, on_use, nextuse, probs, out, jobs):
    """Replay job j = (layer layers[j], capacity caps[j]) for every j in jobs; counts into out [J, 12]. uses [N, L, k]
    as the caller holds it: each job reads its layer's column in place (no [L, N, k] copy). Without the GIL, so
    that threads replay disjoint jobs at once."""
    for j in jobs:
        l = layers[j]
        run_layer(uses[:, l], phases, poff[l], pids, has_pred, prm[j], iprm[j], caps[j], E, buffer, on_use, nextuse[l],
                  probs[l], out[j])
