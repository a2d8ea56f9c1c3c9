"""LRU: evict the resident expert whose last use is oldest. One list in rows 0-1 of I (sentinel E), oldest first."""
from __future__ import annotations

from fate_lab.policy.kernels.blocks import ll_append, ll_first_unprotected, ll_reset, ll_unlink
from fate_lab.policy.kernels.record import Policy, kernel


@kernel
def init(I, F, S, G, R, E, cap, prm, iprm, uses):
    ll_reset(I, 0, 1, E)
    S[0] = 0
    S[1] = cap


@kernel
def admit(I, F, S, G, R, E, e, prot):
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


@kernel
def access(I, F, S, G, R, E, e):
    ll_unlink(I, 0, 1, e)
    ll_append(I, 0, 1, E, e)


POLICY = Policy("lru", init, admit, access, kind="classic", summary="least recently used")
