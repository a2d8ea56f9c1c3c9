"""Router-EMA: evict the resident expert with the lowest decayed average of the router's probability (the project's
policy beyond ARC).

LRU, ARC and LRFU see only the top-k experts each token picked; the router's full distribution also says which
experts came close. Each token decays every score by ``decay`` and adds ``(1 - decay) x p(e)``; a call of n tokens
with mean probabilities p does it n times at once (``decay ** n``). Ties go to the least recently used. ``decay=0.9``
(about a 10-token memory) was the best of 0.5-0.98 on the embedded tiny_moe's calibration trace at 25% cached.
State: the score of every expert in F[K1] (the key), the time of its last use in I[K2]; the residents in the ranked
array (every score changes at each call: never a heap); S[2] the time; G[0] decay.
"""
from __future__ import annotations

from fate_lab.policy.kernels.blocks import K1, K2, ranked_admit, ranked_init, ranked_insert
from fate_lab.policy.kernels.record import Policy, kernel


def setup(capacity: int, decay: float = 0.9) -> tuple[list[float], list[int]]:
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    return [float(decay)], []


@kernel
def init(I, F, S, G, R, E, cap, prm, iprm, uses):
    ranked_init(I, S, cap, cap)
    G[0] = prm[0]
    I[K2, :] = -1


@kernel
def observe(I, F, S, G, R, E, probs, n):
    d = G[0] ** float(max(1, n))
    for x in range(min(E, probs.shape[0])):
        F[K1, x] = d * F[K1, x] + (1.0 - d) * probs[x]


@kernel
def access(I, F, S, G, R, E, e):
    S[2] += 1
    I[K2, e] = S[2]


@kernel
def admit(I, F, S, G, R, E, e, prot):
    v = ranked_admit(I, F, S, e, prot)
    if v == e:
        return e
    access(I, F, S, G, R, E, e)
    ranked_insert(I, F, S, e)
    return v


POLICY = Policy("router_ema", init, admit, access, setup, ("decay",), observe=observe, needs_scores=True,
                kind="moe", summary="the router's own decayed probability (reads the router)")
