"""Compiled twins of `policy/replacement.py`'s LRU, LFU, ARC, LRFU and Belady, for the fast replay.

What this file is: numba functions that keep one policy's state in the rows of a few arrays
(``I`` int64 ``[12, E + 8]``, ``F`` float64 ``[4, E + 8]``, scalars ``S`` int64 and ``G`` float64),
with the pure classes' exact decisions -- same victims, same tie-breaks, same float arithmetic
(`tests/sim/test_fast_replay.py` requires identical counts). ``admit(e, prot)`` is called only for a
non-resident ``e`` (the driver knows residency) and returns -1 (inserted, nothing evicted), the
victim, or ``e`` (nothing may be evicted: not cached); ``prot[x]`` != 0 marks protected ids.
Rows 8-11 of ``I`` and row 3 of ``F`` hold the residents of the policies ordered by a key (the
"ranked" functions: ids, positions, second key, search stack; first key). ``S[0]`` is the resident
count and ``S[1]`` the capacity.
What it is not: the driver (`driver.py`) or the pure reference (`replacement.py`).
"""
from __future__ import annotations

import math

from numba import njit

from fate_lab.sim.fast.structs import (
    HEAP,
    K1,
    K2,
    POS,
    heap_min_unprotected,
    heap_push,
    heap_remove,
    heap_update,
    ll_append,
    ll_first_unprotected,
    ll_move,
    ll_reset,
    ll_unlink,
)

HEAPED = 31  # S[HEAPED]: 1 if the ranked residents are a heap


# --- the residents of the policies ordered by a key (LFU, LRFU, Belady, least-stale, LeCaR's LFU side):
# a heap above `heap_above` slots (128 by default), else a plain array scanned on eviction, which is
# faster there (a hit costs nothing, and a scan's branches are predictable where a heap's sift is not).
# Keys are unique, so both give the same victims.


@njit(cache=True, _nrt=False, inline="always")
def ranked_init(I, S, cap, heap_above):
    """No residents yet; capacity cap; a heap if cap > heap_above."""
    I[POS, :] = -1
    S[0] = 0
    S[1] = cap
    S[HEAPED] = 1 if cap > heap_above else 0


@njit(cache=True, _nrt=False, inline="always")
def ranked_min(I, F, S, prot):
    """The unprotected resident with the smallest key (F[K1], I[K2]), or -1."""
    if S[HEAPED]:
        return heap_min_unprotected(I, F, S[0], prot)
    best, b1, b2 = -1, 0.0, 0
    for i in range(S[0]):
        x = I[HEAP, i]
        if prot[x]:
            continue
        a1 = F[K1, x]
        if best < 0 or a1 < b1 or (a1 == b1 and I[K2, x] < b2):
            best, b1, b2 = x, a1, I[K2, x]
    return best


@njit(cache=True, _nrt=False, inline="always")
def ranked_remove(I, F, S, x):
    """x is no longer resident."""
    if S[HEAPED]:
        S[0] = heap_remove(I, F, S[0], x)
        return
    i = I[POS, x]
    n = S[0] - 1
    last = I[HEAP, n]
    I[HEAP, i] = last
    I[POS, last] = i
    I[POS, x] = -1
    S[0] = n


@njit(cache=True, _nrt=False, inline="always")
def ranked_insert(I, F, S, e):
    """Add e (its keys already set) to the residents."""
    if S[HEAPED]:
        S[0] = heap_push(I, F, S[0], e)
        return
    I[HEAP, S[0]] = e
    I[POS, e] = S[0]
    S[0] += 1


@njit(cache=True, _nrt=False, inline="always")
def ranked_rekey(I, F, S, e):
    """A resident's keys changed."""
    if S[HEAPED]:
        heap_update(I, F, S[0], e)


@njit(cache=True, _nrt=False, inline="always")
def ranked_evict(I, F, S, prot):
    """Remove and return the unprotected resident with the smallest key (-1 if there is none)."""
    v = ranked_min(I, F, S, prot)
    if v >= 0:
        ranked_remove(I, F, S, v)
    return v


# --- LRU: one list, oldest first ----------------------------------------------------------------


@njit(cache=True, _nrt=False, inline="always")
def lru_init(I, S, E, cap):
    ll_reset(I, 0, 1, E)
    S[0] = 0
    S[1] = cap


@njit(cache=True, _nrt=False, inline="always")
def lru_admit(I, S, E, e, prot):
    if S[0] < S[1]:
        ll_append(I, 0, 1, E, e)
        S[0] += 1
        return -1
    v = ll_first_unprotected(I, 0, E, prot)
    if v < 0:
        return e
    ll_unlink(I, 0, 1, v)
    ll_append(I, 0, 1, E, e)
    return v


@njit(cache=True, _nrt=False, inline="always")
def lru_access(I, E, e):
    ll_unlink(I, 0, 1, e)
    ll_append(I, 0, 1, E, e)


# --- LFU: key (count, time of last reference); I[0] counts, S[2] time, S[3] keep_history --------------


@njit(cache=True, _nrt=False, inline="always")
def lfu_ref(I, F, S, e):
    S[2] += 1
    I[0, e] += 1
    F[K1, e] = float(I[0, e])
    I[K2, e] = S[2]


@njit(cache=True, _nrt=False, inline="always")
def lfu_admit(I, F, S, e, prot):
    v = -1
    if S[0] >= S[1]:
        v = ranked_evict(I, F, S, prot)
        if v < 0:
            return e
        if S[3] == 0:
            I[0, v] = 0
    lfu_ref(I, F, S, e)
    ranked_insert(I, F, S, e)
    return v


@njit(cache=True, _nrt=False, inline="always")
def lfu_access(I, F, S, e):
    lfu_ref(I, F, S, e)
    ranked_rekey(I, F, S, e)


# --- LRFU: F[0] score at I[0] (time of it), I[1] has a score; G[0] lam, G[1] decay; S[2] time, S[3] keep --
# G[POW0 + d] = decay ** d for d < POW_TABLE: the same pow() values, computed once (a pow per hit is LRFU's cost)

POW0, POW_TABLE = 8, 4096


@njit(cache=True, _nrt=False, inline="always")
def lrfu_init(G, lam, decay):
    G[0], G[1] = lam, decay
    for d in range(POW_TABLE):
        G[POW0 + d] = decay ** float(d)



@njit(cache=True, _nrt=False, inline="always")
def lrfu_ref(I, F, S, G, e):
    S[2] += 1
    t = S[2]
    score = 0.0
    if I[1, e]:
        d = t - I[0, e]
        score = F[0, e] * (G[POW0 + d] if d < POW_TABLE else G[1] ** float(d))
    crf = 1.0 + score
    F[0, e] = crf
    I[0, e] = t
    I[1, e] = 1
    F[K1, e] = math.log2(crf) + G[0] * float(t)
    I[K2, e] = t


@njit(cache=True, _nrt=False, inline="always")
def lrfu_admit(I, F, S, G, e, prot):
    v = -1
    if S[0] >= S[1]:
        v = ranked_evict(I, F, S, prot)
        if v < 0:
            return e
        if S[3] == 0:
            I[1, v] = 0
            F[0, v] = 0.0
    lrfu_ref(I, F, S, G, e)
    ranked_insert(I, F, S, e)
    return v


@njit(cache=True, _nrt=False, inline="always")
def lrfu_access(I, F, S, G, e):
    lrfu_ref(I, F, S, G, e)
    ranked_rekey(I, F, S, e)


# --- Belady: I[0] next use (token index, N if never), key (-next use, id) --------------------------


@njit(cache=True, _nrt=False, inline="always")
def belady_admit(I, F, S, e, prot):
    v = -1
    if S[0] >= S[1]:
        v = ranked_evict(I, F, S, prot)
        if v < 0:
            return e
    F[K1, e] = -float(I[0, e])
    I[K2, e] = e
    ranked_insert(I, F, S, e)
    return v


@njit(cache=True, _nrt=False, inline="always")
def belady_next_use(I, F, S, e, t):
    """Expert e is next used at token t (after its use now)."""
    I[0, e] = t
    if I[POS, e] >= 0:
        F[K1, e] = -float(t)
        ranked_rekey(I, F, S, e)


# --- ARC: lists T1, T2, B1, B2 (codes 1-4, sentinels E..E+3, sizes S[2..5]), I[2] code; G[0] p -------


@njit(cache=True, _nrt=False, inline="always")
def arc_init(I, S, G, E, cap):
    for c in range(4):
        ll_reset(I, 0, 1, E + c)
        S[2 + c] = 0
    S[1] = cap
    G[0] = 0.0


@njit(cache=True, _nrt=False, inline="always")
def arc_put(I, S, E, e, code):
    """Move e to the MRU end of list `code` (0: out of every list); list lengths in S[2:6]."""
    ll_move(I, S, E, e, code, 1)


@njit(cache=True, _nrt=False, inline="always")
def arc_replace(I, S, G, E, in_b2, prot):
    n1 = S[2]
    prefer_t1 = n1 > 0 and (n1 > G[0] or (in_b2 and n1 == G[0]))
    first = 1 if prefer_t1 else 2
    for src in (first, 3 - first):
        v = ll_first_unprotected(I, 0, E + src - 1, prot)
        if v >= 0:
            arc_put(I, S, E, v, src + 2)
            return v
    return -1


@njit(cache=True, _nrt=False, inline="always")
def arc_admit(I, S, G, E, e, prot):
    c = S[1]
    t1, t2, b1, b2 = S[2], S[3], S[4], S[5]
    full = t1 + t2 >= c
    where = I[2, e]
    v = -1
    if where == 3 or where == 4:  # ghost hit: B1 (recency short) or B2 (frequency short)
        delta = max(float(b2) / float(b1), 1.0) if where == 3 else max(float(b1) / float(b2), 1.0)
        p0 = G[0]
        G[0] = min(float(c), G[0] + delta) if where == 3 else max(0.0, G[0] - delta)  # before REPLACE, as the paper
        if full:
            v = arc_replace(I, S, G, E, where == 4, prot)
            if v < 0:
                G[0] = p0
                return e
        arc_put(I, S, E, e, 2)
        return v
    l1 = t1 + b1
    if l1 >= c:
        if t1 < c:
            if full:
                v = arc_replace(I, S, G, E, False, prot)
                if v < 0:
                    return e
            arc_put(I, S, E, I[0, E + 2], 0)  # B1's LRU
        else:
            v = ll_first_unprotected(I, 0, E, prot)
            if v < 0:
                return e
            arc_put(I, S, E, v, 0)
    elif l1 + t2 + b2 >= c:
        if full:
            v = arc_replace(I, S, G, E, False, prot)
            if v < 0:
                return e
        if S[2] + S[3] + S[4] + S[5] >= 2 * c and S[5] > 0:
            arc_put(I, S, E, I[0, E + 3], 0)  # B2's LRU
    arc_put(I, S, E, e, 1)
    return v


@njit(cache=True, _nrt=False, inline="always")
def arc_access(I, S, E, e):
    arc_put(I, S, E, e, 2)
