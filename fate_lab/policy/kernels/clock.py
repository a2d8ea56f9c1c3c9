"""CLOCK (Corbato 1968; the "second chance" of operating systems' page caches): the slots form a ring with a hand,
and each resident has a reference bit.

A use sets the expert's bit; a new expert enters with the bit clear, in the slot of the one it evicts. To evict, the
hand sweeps the ring from where it rests: an expert with its bit set loses it and is passed, the first with a clear
bit goes, and the hand rests on the slot after it. Protected experts are passed with their bit kept. As
libCacheSim's Clock with a one-bit counter. State: I[0, s] the expert in slot s, I[1, e] the slot of e, I[2, e] the
bit; S[0] the residents, S[1] the slots, S[2] the hand.
"""
from __future__ import annotations

from fate_lab.policy.kernels.record import Policy, kernel


@kernel
def init(I, F, S, G, R, E, cap, prm, iprm, uses):
    S[0], S[1], S[2] = 0, cap, 0


@kernel
def admit(I, F, S, G, R, E, e, prot):
    n = S[1]
    if n == 0:
        return e
    if S[0] < n:  # a free slot: the next one in the ring
        I[0, S[0]] = e
        I[1, e] = S[0]
        I[2, e] = 0
        S[0] += 1
        return -1
    free = False
    for s in range(n):
        if not prot[I[0, s]]:
            free = True
            break
    if not free:
        return e  # every resident protected: nothing changes
    while True:  # within two turns: the first turn clears every unprotected bit
        x = I[0, S[2]]
        if not prot[x]:
            if I[2, x] == 0:
                I[0, S[2]] = e
                I[1, e] = S[2]
                I[2, e] = 0
                S[2] = (S[2] + 1) % n
                return x
            I[2, x] = 0
        S[2] = (S[2] + 1) % n


@kernel
def access(I, F, S, G, R, E, e):
    I[2, e] = 1


POLICY = Policy("clock", init, admit, access, summary="CLOCK, second chance (Corbato 1968)")
