"""ARC, the Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), as in Fate's reference code.

T1 holds ids used once recently, T2 ids used at least twice; B1 and B2 are ghost lists of ids evicted from T1 and T2.
``p``, the adaptive target size of T1, grows on a ghost hit in B1 and shrinks on one in B2. ``admit`` is ARC's miss
path (cases II-IV), ``access`` its hit path (case I). State: lists T1, T2, B1, B2 (codes 1-4, sentinels E..E+3,
lengths S[2..5]) in rows 0-1 of I, I[2] the list of each id; G[0] p.
"""
from __future__ import annotations

from fate_lab.policy.kernels.blocks import ll_first_unprotected, ll_move, ll_reset
from fate_lab.policy.kernels.record import Policy, kernel


@kernel
def init(I, F, S, G, R, E, cap, prm, iprm, uses):
    for c in range(4):
        ll_reset(I, 0, 1, E + c)
        S[2 + c] = 0
    S[1] = cap
    G[0] = 0.0


@kernel
def put(I, S, E, e, code):
    """Move e to the MRU end of list `code` (0: out of every list)."""
    ll_move(I, S, E, e, code, 1)


@kernel
def replace(I, S, G, E, in_b2, prot):
    """ARC's REPLACE: demote the LRU of T1 (to B1) or of T2 (to B2); -1 if all are protected."""
    n1 = S[2]
    prefer_t1 = n1 > 0 and (n1 > G[0] or (in_b2 and n1 == G[0]))
    first = 1 if prefer_t1 else 2
    for src in (first, 3 - first):
        v = ll_first_unprotected(I, 0, E + src - 1, prot)
        if v >= 0:
            put(I, S, E, v, src + 2)
            return v
    return -1


@kernel
def admit(I, F, S, G, R, E, e, prot):
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
            v = replace(I, S, G, E, where == 4, prot)
            if v < 0:
                G[0] = p0  # nothing admitted: nothing changes
                return e
        put(I, S, E, e, 2)
        return v
    l1 = t1 + b1
    if l1 >= c:
        if t1 < c:
            if full:
                v = replace(I, S, G, E, False, prot)
                if v < 0:
                    return e
            put(I, S, E, I[0, E + 2], 0)  # B1's LRU
        else:  # B1 empty, T1 the whole cache: drop T1's LRU without a ghost
            v = ll_first_unprotected(I, 0, E, prot)
            if v < 0:
                return e
            put(I, S, E, v, 0)
    elif l1 + t2 + b2 >= c:
        if full:
            v = replace(I, S, G, E, False, prot)
            if v < 0:
                return e
        if S[2] + S[3] + S[4] + S[5] >= 2 * c and S[5] > 0:
            put(I, S, E, I[0, E + 3], 0)  # B2's LRU
    put(I, S, E, e, 1)
    return v


@kernel
def access(I, F, S, G, R, E, e):
    put(I, S, E, e, 2)  # case I: a hit moves e to the MRU end of T2


POLICY = Policy("arc", init, admit, access, kind="classic", summary="adaptive replacement cache (Megiddo & Modha 2003)")
