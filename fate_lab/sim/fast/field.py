"""Compiled twins of S3-FIFO, SIEVE, LIRS, LeCaR (`policy/replacement_field.py`) and least-stale
(`policy/replacement_moe.py`), for the fast replay.

What this file is: numba functions with the pure classes' exact decisions, over the state arrays
and conventions of `classic.py` (``admit`` for a non-resident id; -1, a victim, or ``e``; ``S[1]``
the capacity). Queues are the intrusive lists of `structs.py`, oldest member first.
What it is not: the definition of these policies -- that is the pure classes, which the parity
tests compare this file against.
"""
from __future__ import annotations

import math

from numba import njit

from fate_lab.sim.fast.classic import ranked_init, ranked_insert, ranked_min, ranked_rekey, ranked_remove
from fate_lab.sim.fast.structs import (
    HEAP,
    K1,
    K2,
    ll_append,
    ll_first_unprotected,
    ll_move,
    ll_reset,
    ll_unlink,
    splitmix_uniform,
)

# --- S3-FIFO: lists small, main, ghost (codes 1-3, sentinels E..E+2, sizes S[11..13]); I[2] code, I[3] count
# S[4] small share, S[5] main share, S[6] ghost size, S[7] move threshold, S[8] has evicted


@njit(cache=True, _nrt=False, inline="always")
def s3_init(I, S, E, cap, small_cap, ghost_cap, threshold):
    for c in range(3):
        ll_reset(I, 0, 1, E + c)
        S[11 + c] = 0
    S[1], S[4], S[5], S[6], S[7], S[8] = cap, small_cap, cap - small_cap, ghost_cap, threshold, 0


@njit(cache=True, _nrt=False, inline="always")
def s3_put(I, S, E, e, code):
    """Move e to the new end of S3-FIFO's queue `code` (0: out of every queue); queue lengths in S[11:14]."""
    ll_move(I, S, E, e, code, 10)


@njit(cache=True, _nrt=False, inline="always")
def s3_evict_small(I, S, E, prot):
    x = I[0, E]
    while x != E:
        nxt = I[0, x]
        if not prot[x]:
            if I[3, x] >= S[7]:
                s3_put(I, S, E, x, 2)
                I[3, x] = 0
            else:
                s3_put(I, S, E, x, 0)
                if S[6] > 0:
                    if S[13] >= S[6]:
                        s3_put(I, S, E, I[0, E + 2], 0)
                    s3_put(I, S, E, x, 3)
                return x
        x = nxt
    return -1


@njit(cache=True, _nrt=False, inline="always")
def s3_evict_main(I, S, E, prot):
    while True:
        seen = False
        x = I[0, E + 1]
        for _ in range(S[12]):
            nxt = I[0, x]
            if not prot[x]:
                seen = True
                f = I[3, x]
                if f == 0:
                    s3_put(I, S, E, x, 0)
                    return x
                s3_put(I, S, E, x, 2)  # reinserted at the new end
                I[3, x] = min(f, 3) - 1
            x = nxt
        if not seen:
            return -1


@njit(cache=True, _nrt=False, inline="always")
def s3_admit(I, S, E, e, prot):
    full = S[11] + S[12] >= S[1]
    if full and ll_first_unprotected(I, 0, E, prot) < 0 and ll_first_unprotected(I, 0, E + 1, prot) < 0:
        return e
    ghost_hit = I[2, e] == 3
    if ghost_hit:
        s3_put(I, S, E, e, 0)
    v = -1
    if full:
        S[8] = 1
        if S[12] > S[5] or S[11] == 0:
            v = s3_evict_main(I, S, E, prot)
            if v < 0:
                v = s3_evict_small(I, S, E, prot)
        else:
            v = s3_evict_small(I, S, E, prot)
            if v < 0:
                v = s3_evict_main(I, S, E, prot)
    s3_put(I, S, E, e, 2 if ghost_hit or (S[8] == 0 and S[11] >= S[4]) else 1)
    I[3, e] = 0
    return v


@njit(cache=True, _nrt=False, inline="always")
def s3_access(I, e):
    I[3, e] += 1


# --- SIEVE: one list, I[2] visited, S[0] size, S[2] hand (-1: start at the oldest) ---------------------


@njit(cache=True, _nrt=False, inline="always")
def sieve_init(I, S, E, cap):
    ll_reset(I, 0, 1, E)
    S[0], S[1], S[2] = 0, cap, -1


@njit(cache=True, _nrt=False, inline="always")
def sieve_admit(I, S, E, e, prot):
    v = -1
    if S[0] >= S[1]:
        if ll_first_unprotected(I, 0, E, prot) < 0:
            return e
        x = I[0, E] if S[2] < 0 else S[2]
        while prot[x] or I[2, x]:
            if not prot[x]:
                I[2, x] = 0
            x = I[0, x]
            if x == E:
                x = I[0, E]
        S[2] = I[0, x] if I[0, x] != E else -1
        ll_unlink(I, 0, 1, x)
        v = x
    else:
        S[0] += 1
    ll_append(I, 0, 1, E, e)
    I[2, e] = 0
    return v


@njit(cache=True, _nrt=False, inline="always")
def sieve_access(I, e):
    I[2, e] = 1


# --- LIRS: stack S (I[0], I[1], sentinel E), Q and non-resident list (I[2], I[3], sentinels E, E+1),
# I[4] in S, I[5] 1: in Q, 2: non-resident in S, I[6] LIR; S[0] |S|, S[2] |Q|, S[3] |LIR|, S[4] |NR|,
# S[5] HIR share, S[6] LIR share, S[7] max |S|


@njit(cache=True, _nrt=False, inline="always")
def lirs_init(I, S, E, cap, hir_cap, stack_cap):
    ll_reset(I, 0, 1, E)
    ll_reset(I, 2, 3, E)
    ll_reset(I, 2, 3, E + 1)
    S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7] = 0, cap, 0, 0, 0, hir_cap, cap - hir_cap, stack_cap


@njit(cache=True, _nrt=False, inline="always")
def lirs_push(I, S, E, e):
    if I[4, e]:
        ll_unlink(I, 0, 1, e)
    else:
        I[4, e] = 1
        S[0] += 1
    ll_append(I, 0, 1, E, e)


@njit(cache=True, _nrt=False, inline="always")
def lirs_unstack(I, S, e):
    ll_unlink(I, 0, 1, e)
    I[4, e] = 0
    S[0] -= 1


@njit(cache=True, _nrt=False, inline="always")
def lirs_put(I, S, E, e, code):
    """Move e to the end of Q (1), of the non-resident list (2), or out of both (0)."""
    old = I[5, e]
    if old != 0:
        ll_unlink(I, 2, 3, e)
        S[2 if old == 1 else 4] -= 1
    if code != 0:
        ll_append(I, 2, 3, E + code - 1, e)
        S[2 if code == 1 else 4] += 1
    I[5, e] = code


@njit(cache=True, _nrt=False, inline="always")
def lirs_prune(I, S, E):
    while S[0] > 0:
        x = I[0, E]
        if I[6, x]:
            break
        lirs_unstack(I, S, x)
        if I[5, x] == 2:
            lirs_put(I, S, E, x, 0)


@njit(cache=True, _nrt=False, inline="always")
def lirs_to_lir(I, S, E, e):
    I[6, e] = 1
    S[3] += 1
    lirs_push(I, S, E, e)
    if S[3] > S[6]:  # the LIR id nearest the bottom becomes resident HIR at the end of Q
        x = I[0, E]
        while not I[6, x]:
            x = I[0, x]
        lirs_unstack(I, S, x)
        I[6, x] = 0
        S[3] -= 1
        lirs_put(I, S, E, x, 1)
        lirs_prune(I, S, E)


@njit(cache=True, _nrt=False, inline="always")
def lirs_limit(I, S, E):
    while S[0] > S[7] and S[4] > 0:
        x = I[2, E + 1]
        lirs_put(I, S, E, x, 0)
        lirs_unstack(I, S, x)


@njit(cache=True, _nrt=False, inline="always")
def lirs_access(I, S, E, e):
    if I[6, e]:
        lirs_push(I, S, E, e)
        lirs_prune(I, S, E)
    elif I[4, e]:
        lirs_put(I, S, E, e, 0)
        lirs_to_lir(I, S, E, e)
    else:
        lirs_push(I, S, E, e)
        lirs_put(I, S, E, e, 1)
    lirs_limit(I, S, E)


@njit(cache=True, _nrt=False, inline="always")
def lirs_admit(I, S, E, e, prot):
    v = -1
    if S[3] + S[2] >= S[1]:
        v = ll_first_unprotected(I, 2, E, prot)
        if v >= 0:
            lirs_put(I, S, E, v, 2 if I[4, v] else 0)
        else:
            x = I[0, E]
            while x != E and not (I[6, x] and not prot[x]):
                x = I[0, x]
            if x == E:
                return e
            v = x
            lirs_unstack(I, S, v)
            I[6, v] = 0
            S[3] -= 1
            lirs_prune(I, S, E)
    elif S[3] < S[6]:  # filling: the first ids become LIR
        if I[5, e] == 2:
            lirs_put(I, S, E, e, 0)
        I[6, e] = 1
        S[3] += 1
        lirs_push(I, S, E, e)
        lirs_limit(I, S, E)
        return -1
    if I[4, e]:
        lirs_put(I, S, E, e, 0)
        lirs_to_lir(I, S, E, e)
    else:
        lirs_push(I, S, E, e)
        lirs_put(I, S, E, e, 1)
    lirs_limit(I, S, E)
    return v


# --- LeCaR: LRU list (I[0], I[1]), histories (I[2], I[3], sentinels E, E+1; I[4] 1/2; I[5] eviction time),
# LFU heap (count F[3], last I[10]); S[2] history size, S[3] time, S[4..5] history lengths;
# G[0] learning rate, G[1] discount, G[2] w_lru; R[0] SplitMix64 state


@njit(cache=True, _nrt=False, inline="always")
def lecar_init(I, S, G, R, E, cap, hist_cap, lr, discount, w_lru, seed, heap_above):
    ranked_init(I, S, cap, heap_above)
    ll_reset(I, 0, 1, E)
    ll_reset(I, 2, 3, E)
    ll_reset(I, 2, 3, E + 1)
    S[2], S[3], S[4], S[5] = hist_cap, 0, 0, 0
    G[0], G[1], G[2] = lr, discount, w_lru
    R[0] = seed


@njit(cache=True, _nrt=False, inline="always")
def lecar_forget(I, S, e):
    h = I[4, e]
    ll_unlink(I, 2, 3, e)
    S[3 + h] -= 1
    I[4, e] = 0


@njit(cache=True, _nrt=False, inline="always")
def lecar_access(I, F, S, E, e):
    S[3] += 1
    ll_unlink(I, 0, 1, e)
    ll_append(I, 0, 1, E, e)
    F[K1, e] += 1.0
    I[K2, e] = S[3]
    ranked_rekey(I, F, S, e)


@njit(cache=True, _nrt=False, inline="always")
def lecar_admit(I, F, S, G, R, E, e, prot):
    full = S[0] >= S[1]
    by_lru = ll_first_unprotected(I, 0, E, prot) if full else -1
    if full and by_lru < 0:
        return e
    S[3] += 1
    h = I[4, e]
    if h != 0:  # regret: the expert that evicted e loses weight against the other
        gain = math.exp(G[0] * G[1] ** float(S[3] - I[5, e]))
        lecar_forget(I, S, e)
        w_lru, w_lfu = G[2], 1.0 - G[2]
        if h == 1:
            w_lfu = w_lfu * gain
        else:
            w_lru = w_lru * gain
        G[2] = w_lru / (w_lru + w_lfu)
    v = -1
    if full:
        by_lfu = ranked_min(I, F, S, prot)
        v, expert = by_lru, 0
        if by_lru != by_lfu:
            expert = 1 if splitmix_uniform(R) < G[2] else 2
            v = by_lru if expert == 1 else by_lfu
        ll_unlink(I, 0, 1, v)
        ranked_remove(I, F, S, v)
        if expert != 0 and S[2] > 0:
            if S[3 + expert] >= S[2]:
                lecar_forget(I, S, I[2, E + expert - 1])
            ll_append(I, 2, 3, E + expert - 1, v)
            S[3 + expert] += 1
            I[4, v] = expert
            I[5, v] = S[3]
    ll_append(I, 0, 1, E, e)
    F[K1, e] = 1.0
    I[K2, e] = S[3]
    ranked_insert(I, F, S, e)
    return v


# --- least-stale: I[0] last use, I[1] has a record, F[0] learned interval; the residents in the ranked array
# (never a heap: staleness changes with time), scanned on eviction; S[2] time, S[3] keep_history; G[0] alpha


@njit(cache=True, _nrt=False, inline="always")
def stale_ref(I, F, S, G, e):
    S[2] += 1
    t = S[2]
    if I[1, e]:
        gap = float(t - I[0, e])
        old = F[0, e]
        F[0, e] = gap if old == 0.0 else (1.0 - G[0]) * old + G[0] * gap
    else:
        F[0, e] = 0.0
        I[1, e] = 1
    I[0, e] = t


@njit(cache=True, _nrt=False, inline="always")
def stale_admit(I, F, S, G, e, prot):
    v = -1
    if S[0] >= S[1]:
        now = S[2] + 1
        best, bs, bl = -1, 0.0, 0
        for i in range(S[0]):
            x = I[HEAP, i]
            if prot[x]:
                continue
            st = float(now - I[0, x]) / max(F[0, x], 1.0)
            if best < 0 or st > bs or (st == bs and I[0, x] < bl):
                best, bs, bl = x, st, I[0, x]
        if best < 0:
            return e
        v = best
        ranked_remove(I, F, S, v)
        if S[3] == 0:
            I[1, v] = 0
    stale_ref(I, F, S, G, e)
    ranked_insert(I, F, S, e)
    return v


@njit(cache=True, _nrt=False, inline="always")
def stale_access(I, F, S, G, e):
    stale_ref(I, F, S, G, e)
