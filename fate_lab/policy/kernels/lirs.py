"""LIRS (Jiang & Zhang, SIGMETRICS 2002): keep the ids with a low inter-reference recency (LIR).

The stack S orders LIR ids, resident HIR ids and non-resident HIR ids by recency, pruned so that its bottom is an LIR
id; the queue Q holds the resident HIR ids (``hir_ratio`` of the capacity, at least 1), the only ones evicted. A hit
on a resident HIR id still in S makes it LIR and demotes the bottom LIR id to the end of Q; a miss on an id still in
S (non-resident HIR) admits it as LIR the same way; other ids enter Q as HIR. Until the cache is full the first ids
become LIR. S keeps at most ``stack_ratio`` x capacity entries (the oldest non-resident ones go first, as
libCacheSim). This is the paper's algorithm; libCacheSim's LIRS also demotes an LIR id when a resident HIR id absent
from S is hit. Protect: if every id of Q is protected, the unprotected LIR id nearest the bottom of S goes.
State: stack S in rows 0-1 (sentinel E), Q and the non-resident list in rows 2-3 (sentinels E, E+1); I[4] in S,
I[5] 1: in Q, 2: non-resident in S, I[6] LIR; S[0] |S|, S[2] |Q|, S[3] |LIR|, S[4] |NR|, S[5] HIR share, S[6] LIR
share, S[7] the most S holds.
"""
from __future__ import annotations

from fate_lab.policy.kernels.blocks import ll_append, ll_first_unprotected, ll_reset, ll_unlink
from fate_lab.policy.kernels.record import Policy, kernel, ratio


def setup(capacity: int, hir_ratio: float = 0.01, stack_ratio: float = 2.0) -> tuple[list[float], list[int]]:
    hir = max(1, int(capacity * ratio("hir_ratio", hir_ratio))) if capacity else 0
    if stack_ratio < 1.0:
        raise ValueError(f"stack_ratio must be >= 1 (S holds at least the resident ids), got {stack_ratio}")
    return [], [hir, int(stack_ratio * capacity)]


@kernel
def init(I, F, S, G, R, E, cap, prm, iprm, uses):
    ll_reset(I, 0, 1, E)
    ll_reset(I, 2, 3, E)
    ll_reset(I, 2, 3, E + 1)
    S[0], S[1], S[2], S[3], S[4], S[5], S[6], S[7] = 0, cap, 0, 0, 0, iprm[0], cap - iprm[0], iprm[1]


@kernel
def push(I, S, E, e):
    if I[4, e]:
        ll_unlink(I, 0, 1, e)
    else:
        I[4, e] = 1
        S[0] += 1
    ll_append(I, 0, 1, E, e)


@kernel
def unstack(I, S, e):
    ll_unlink(I, 0, 1, e)
    I[4, e] = 0
    S[0] -= 1


@kernel
def put(I, S, E, e, code):
    """Move e to the end of Q (1), of the non-resident list (2), or out of both (0)."""
    old = I[5, e]
    if old != 0:
        ll_unlink(I, 2, 3, e)
        S[2 if old == 1 else 4] -= 1
    if code != 0:
        ll_append(I, 2, 3, E + code - 1, e)
        S[2 if code == 1 else 4] += 1
    I[5, e] = code


@kernel
def prune(I, S, E):
    while S[0] > 0:
        x = I[0, E]
        if I[6, x]:
            break
        unstack(I, S, x)
        if I[5, x] == 2:
            put(I, S, E, x, 0)


@kernel
def to_lir(I, S, E, e):
    I[6, e] = 1
    S[3] += 1
    push(I, S, E, e)
    if S[3] > S[6]:  # the LIR id nearest the bottom becomes resident HIR at the end of Q
        x = I[0, E]
        while not I[6, x]:
            x = I[0, x]
        unstack(I, S, x)
        I[6, x] = 0
        S[3] -= 1
        put(I, S, E, x, 1)
        prune(I, S, E)


@kernel
def limit(I, S, E):
    while S[0] > S[7] and S[4] > 0:
        x = I[2, E + 1]
        put(I, S, E, x, 0)
        unstack(I, S, x)


@kernel
def access(I, F, S, G, R, E, e):
    if I[6, e]:
        push(I, S, E, e)
        prune(I, S, E)
    elif I[4, e]:
        put(I, S, E, e, 0)
        to_lir(I, S, E, e)
    else:
        push(I, S, E, e)
        put(I, S, E, e, 1)
    limit(I, S, E)


@kernel
def admit(I, F, S, G, R, E, e, prot):
    v = -1
    if S[3] + S[2] >= S[1]:
        v = ll_first_unprotected(I, 2, E, prot)
        if v >= 0:
            put(I, S, E, v, 2 if I[4, v] else 0)
        else:
            x = I[0, E]
            while x != E and not (I[6, x] and not prot[x]):
                x = I[0, x]
            if x == E:
                return e
            v = x
            unstack(I, S, v)
            I[6, v] = 0
            S[3] -= 1
            prune(I, S, E)
    elif S[3] < S[6]:  # filling: the first ids become LIR
        if I[5, e] == 2:
            put(I, S, E, e, 0)
        I[6, e] = 1
        S[3] += 1
        push(I, S, E, e)
        limit(I, S, E)
        return -1
    if I[4, e]:
        put(I, S, E, e, 0)
        to_lir(I, S, E, e)
    else:
        push(I, S, E, e)
        put(I, S, E, e, 1)
    limit(I, S, E)
    return v


POLICY = Policy("lirs", init, admit, access, setup, ("hir_ratio", "stack_ratio"),
                summary="LIRS (Jiang & Zhang 2002)")
