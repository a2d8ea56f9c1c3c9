"""SIEVE (Zhang et al., NSDI 2024): one FIFO queue, a visited bit per id, and a hand that sweeps from old to new.

A hit sets the id's bit; new ids enter at the new end with the bit clear. To evict, the hand (at the oldest id, or
where it last stopped) clears set bits while it moves towards the new end, wrapping around, and evicts the first id
whose bit is clear; it then rests on the next newer id. libCacheSim's Sieve, plus the protect rule (the hand passes
protected ids by). State: the queue in rows 0-1 of I (sentinel E), I[2] visited, S[2] the hand (-1: the oldest).
"""
from __future__ import annotations

from fate_lab.policy.kernels.blocks import ll_append, ll_first_unprotected, ll_reset, ll_unlink
from fate_lab.policy.kernels.record import Policy, kernel


@kernel
def init(I, F, S, G, R, E, cap, prm, iprm, uses):
    ll_reset(I, 0, 1, E)
    S[0], S[1], S[2] = 0, cap, -1


@kernel
def admit(I, F, S, G, R, E, e, prot):
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


@kernel
def access(I, F, S, G, R, E, e):
    I[2, e] = 1


POLICY = Policy("sieve", init, admit, access, summary="SIEVE (Zhang et al. 2024)")
