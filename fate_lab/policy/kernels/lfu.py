"""LFU: evict the resident with the fewest uses, ties to the least recently used.

``keep_history=True`` ("perfect LFU", the default) keeps an expert's count after eviction, which suits expert
popularity (stable over a session); False resets it on eviction ("in-cache LFU"). State: I[0] counts, key
(count, time of last use) in F[K1], I[K2]; S[2] the time, S[3] keep_history.
"""
from __future__ import annotations

from fate_lab.policy.kernels.blocks import K1, K2, ranked_admit, ranked_init, ranked_insert, ranked_rekey
from fate_lab.policy.kernels.record import Policy, kernel


def setup(capacity: int, keep_history: bool = True) -> tuple[list[float], list[int]]:
    return [], [int(bool(keep_history))]


@kernel
def init(I, F, S, G, R, E, cap, prm, iprm, uses):
    ranked_init(I, S, cap, iprm[7])
    S[3] = iprm[0]


@kernel
def ref(I, F, S, e):
    S[2] += 1
    I[0, e] += 1
    F[K1, e] = float(I[0, e])
    I[K2, e] = S[2]


@kernel
def admit(I, F, S, G, R, E, e, prot):
    v = ranked_admit(I, F, S, e, prot)
    if v == e:
        return e
    if v >= 0 and S[3] == 0:
        I[0, v] = 0
    ref(I, F, S, e)
    ranked_insert(I, F, S, e)
    return v


@kernel
def access(I, F, S, G, R, E, e):
    ref(I, F, S, e)
    ranked_rekey(I, F, S, e)


POLICY = Policy("lfu", init, admit, access, setup, ("keep_history",), kind="classic", summary="least frequently used")
