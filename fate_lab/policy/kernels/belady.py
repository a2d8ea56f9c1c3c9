"""Belady's MIN: evict the resident expert whose next use is furthest in the future (ties: the smallest id goes).

A policy that reads the future: ``init`` gets the layer's uses [N, k] and ``tick(t)`` runs before token t. With no
prefetching it is the miss-count lower bound (for the same protect rule) the other policies are measured against.
State: I[0] next use of each expert (a token index, N if never); key (-next use, id) in F[K1], I[K2].
"""
from __future__ import annotations

from fate_lab.policy.kernels.blocks import K1, K2, POS, ranked_admit, ranked_init, ranked_insert, ranked_rekey
from fate_lab.policy.kernels.record import Policy, kernel


@kernel
def init(I, F, S, G, R, E, cap, prm, iprm, uses):
    ranked_init(I, S, cap, iprm[7])
    n = uses.shape[0]
    I[0, :] = n
    for t in range(n - 1, -1, -1):  # from token 0, an expert's next use is its first
        for j in range(uses.shape[1]):
            I[0, uses[t, j]] = t


@kernel
def admit(I, F, S, G, R, E, e, prot):
    v = ranked_admit(I, F, S, e, prot)
    if v == e:
        return e
    F[K1, e] = -float(I[0, e])
    I[K2, e] = e
    ranked_insert(I, F, S, e)
    return v


@kernel
def access(I, F, S, G, R, E, e):
    pass  # the future is already known


@kernel
def tick(I, F, S, G, R, E, t, uses, nextuse):
    if t == 0:
        return
    for j in range(uses.shape[1]):  # the experts of token t - 1 are next used at nextuse[t - 1, j]
        e = uses[t - 1, j]
        I[0, e] = nextuse[t - 1, j]
        if I[POS, e] >= 0:
            F[K1, e] = -float(I[0, e])
            ranked_rekey(I, F, S, e)


POLICY = Policy("belady", init, admit, access, tick=tick, reads_future=True,
                kind="bound", summary="Belady's MIN, the bound (reads the future)")
