"""Compiled building blocks of the replacement policies (numba): intrusive linked lists, an indexed heap, a
key-ordered resident set, SplitMix64.

What this file is: numba functions over plain int64/float64 arrays of size about E (the experts of one layer),
which the policy files of this package combine. Nodes are expert ids ``0..E-1``; a list's sentinel is an index
``>= E`` of the same next/previous rows, so several lists whose members are disjoint share one pair of rows. The
heap keeps ids ordered by the pair ``(F[K1, e], I[K2, e])`` (float, int; smallest first) with ``I[POS, e]`` its
index or -1. Every function allocates nothing and is compiled with ``_nrt=False`` (numba's reference-counting
runtime off: the reference counts it otherwise adds to each call cost 5-10x the work itself, a heap update 86 ns
-> 15 ns) and inlined (``inline="always"``) into its callers, so one admit or access is one call.
What it is not: a policy; nothing here knows about caches.
"""
from __future__ import annotations

import numpy as np
from numba import njit, uint64

# The functions index the state arrays in place (``A[row, i]``) rather than taking row views.

# --- linked lists in rows (rn: next, rp: previous) of A; the head (A[rn, s]) is the oldest member ----------


@njit(cache=True, _nrt=False, inline="always")
def ll_reset(A, rn, rp, s):
    """Make the list with sentinel s empty."""
    A[rn, s] = s
    A[rp, s] = s


@njit(cache=True, _nrt=False, inline="always")
def ll_append(A, rn, rp, s, x):
    """Append x at the new end of list s."""
    p = A[rp, s]
    A[rn, p] = x
    A[rp, x] = p
    A[rn, x] = s
    A[rp, s] = x


@njit(cache=True, _nrt=False, inline="always")
def ll_unlink(A, rn, rp, x):
    """Take x out of whatever list it is in."""
    p = A[rp, x]
    n = A[rn, x]
    A[rn, p] = n
    A[rp, n] = p


@njit(cache=True, _nrt=False, inline="always")
def ll_move(I, S, E, e, code, count_at):
    """Move e to the new end of list `code` (sentinel E + code - 1; 0: out of every list), the list whose
    membership is row 2 of I, keeping each list's length in S[count_at + code] (ARC's and S3-FIFO's lists)."""
    old = I[2, e]
    if old != 0:
        ll_unlink(I, 0, 1, e)
        S[count_at + old] -= 1
    if code != 0:
        ll_append(I, 0, 1, E + code - 1, e)
        S[count_at + code] += 1
    I[2, e] = code


@njit(cache=True, _nrt=False, inline="always")
def ll_first_unprotected(A, rn, s, prot):
    """The oldest member of list s not in prot, or -1."""
    x = A[rn, s]
    while x != s and prot[x]:
        x = A[rn, x]
    return -1 if x == s else x


# --- indexed binary min-heap: ids I[HEAP, :n], positions I[POS] (-1: absent), keys (F[K1], I[K2]) ---------

HEAP, POS, K2, STACK = 8, 9, 10, 11  # rows of I (STACK: scratch of heap_min_unprotected)
K1 = 3  # row of F




@njit(cache=True, _nrt=False, inline="always")
def heap_up(I, F, i):
    """Sift the entry at index i towards the root."""
    x = I[HEAP, i]
    a1, a2 = F[K1, x], I[K2, x]
    while i > 0:
        p = (i - 1) >> 1
        y = I[HEAP, p]
        b1 = F[K1, y]
        if not (a1 < b1 or (a1 == b1 and a2 < I[K2, y])):
            break
        I[HEAP, i] = y
        I[POS, y] = i
        i = p
    I[HEAP, i] = x
    I[POS, x] = i


@njit(cache=True, _nrt=False, inline="always")
def heap_down(I, F, n, i):
    """Sift the entry at index i towards the leaves of a heap of n entries."""
    x = I[HEAP, i]
    a1, a2 = F[K1, x], I[K2, x]
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        y = I[HEAP, c]
        if c + 1 < n:
            z = I[HEAP, c + 1]
            if F[K1, z] < F[K1, y] or (F[K1, z] == F[K1, y] and I[K2, z] < I[K2, y]):
                c += 1
                y = z
        b1 = F[K1, y]
        if not (b1 < a1 or (b1 == a1 and I[K2, y] < a2)):
            break
        I[HEAP, i] = y
        I[POS, y] = i
        i = c
    I[HEAP, i] = x
    I[POS, x] = i


@njit(cache=True, _nrt=False, inline="always")
def heap_push(I, F, n, x):
    """Insert x (its keys set); returns the new size."""
    I[HEAP, n] = x
    I[POS, x] = n
    heap_up(I, F, n)
    return n + 1


@njit(cache=True, _nrt=False, inline="always")
def heap_remove(I, F, n, x):
    """Remove x; returns the new size."""
    i = I[POS, x]
    I[POS, x] = -1
    n -= 1
    if i < n:
        last = I[HEAP, n]
        I[HEAP, i] = last
        I[POS, last] = i
        heap_up(I, F, i)
        heap_down(I, F, n, I[POS, last])
    return n


@njit(cache=True, _nrt=False, inline="always")
def heap_update(I, F, n, x):
    """Restore the order after x's keys changed."""
    heap_up(I, F, I[POS, x])
    heap_down(I, F, n, I[POS, x])


@njit(cache=True, _nrt=False, inline="always")
def heap_min_unprotected(I, F, n, prot):
    """The smallest entry not in prot, or -1: only the subtrees under protected entries are searched."""
    if n == 0:
        return -1
    best = -1
    I[STACK, 0] = 0
    top = 1
    while top > 0:
        top -= 1
        i = I[STACK, top]
        x = I[HEAP, i]
        if not prot[x]:
            if best == -1 or F[K1, x] < F[K1, best] or (F[K1, x] == F[K1, best] and I[K2, x] < I[K2, best]):
                best = x
            continue
        c = 2 * i + 1
        if c < n:
            I[STACK, top] = c
            top += 1
            if c + 1 < n:
                I[STACK, top] = c + 1
                top += 1
    return best


# --- SplitMix64 (Steele, Lea & Flood 2014; the stream of Java's SplittableRandom) -----------------------------

_GOLDEN = uint64(0x9E3779B97F4A7C15)
_MUL1 = uint64(0xBF58476D1CE4E5B9)
_MUL2 = uint64(0x94D049BB133111EB)


@njit(cache=True, _nrt=False, inline="always")
def splitmix_uniform(rng):
    """Advance rng[0] and return a uniform float in [0, 1)."""
    s = rng[0] + _GOLDEN
    rng[0] = s
    z = (s ^ (s >> uint64(30))) * _MUL1
    z = (z ^ (z >> uint64(27))) * _MUL2
    z = z ^ (z >> uint64(31))
    return np.float64(z >> uint64(11)) * (1.0 / 9007199254740992.0)


# --- the residents of a policy ordered by a key (LFU, LRFU, Belady, least-stale, router-EMA, LeCaR's LFU side):
# a heap above `heap_above` slots (S[HEAPED] = 1), else a plain array scanned on eviction, which is faster there (a
# hit costs nothing, and a scan's branches are predictable where a heap's sift is not). Keys are unique, so both give
# the same victims. S[0] is the resident count and S[1] the capacity.

HEAPED = 31  # S[HEAPED]: 1 if the ranked residents are a heap


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


@njit(cache=True, _nrt=False, inline="always")
def ranked_admit(I, F, S, e, prot):
    """The full-cache half of a key-ordered admit: -1 (room left), the evicted resident, or e (all protected)."""
    if S[0] < S[1]:
        return -1
    v = ranked_evict(I, F, S, prot)
    return e if v < 0 else v
