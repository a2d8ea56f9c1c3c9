"""LeCaR (Vietri et al., HotStorage 2018): a regret-minimising choice between LRU and LFU at each eviction.

On a full miss, LRU's victim is taken with probability ``w_lru``, else LFU's (fewest uses, then least recent); when
the two differ, the victim is remembered in that expert's history (``capacity // 2`` ids each, FIFO). A miss on an id
found in a history is a regret: the weight of the other expert is multiplied by ``exp(learning_rate x discount **
age)`` (age in uses since the eviction; ``discount = 0.005 ** (1 / capacity)`` by default) and the weights
renormalised. The draws come from SplitMix64 seeded with ``seed``. As libCacheSim: a victim both experts chose goes
to no history and takes no draw; a history hit starts the id again at count 1.
State: the LRU list in rows 0-1 (sentinel E), the two histories in rows 2-3 (sentinels E, E+1), I[4] the history of
an id (1 LRU's, 2 LFU's), I[5] its eviction time; LFU's key (count F[K1], last use I[K2]); S[2] history length,
S[3] the time, S[4..5] the histories' lengths; G[0] learning rate, G[1] discount, G[2] w_lru; R[0] the random state.
"""
from __future__ import annotations

import math

import numpy as np

from fate_lab.policy.kernels.blocks import (
    K1,
    K2,
    ll_append,
    ll_first_unprotected,
    ll_reset,
    ll_unlink,
    ranked_init,
    ranked_insert,
    ranked_min,
    ranked_rekey,
    ranked_remove,
    splitmix_uniform,
)
from fate_lab.policy.kernels.record import Policy, kernel


def setup(capacity: int, learning_rate: float = 0.45, discount: float | None = None, lru_weight: float = 0.5,
          seed: int = 0) -> tuple[list[float], list[int]]:
    if learning_rate < 0 or not 0.0 <= lru_weight <= 1.0:
        raise ValueError(f"need learning_rate >= 0 and lru_weight in [0, 1], got {learning_rate}, {lru_weight}")
    d = (0.005 ** (1.0 / capacity) if capacity else 0.0) if discount is None else float(discount)
    if not 0.0 <= d <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {d}")
    rng = int(np.uint64(int(seed) & (2 ** 64 - 1)).view(np.int64))  # the seed's 64 bits, as an int64
    return [float(learning_rate), d, float(lru_weight)], [capacity // 2, rng]


@kernel
def init(I, F, S, G, R, E, cap, prm, iprm, uses):
    ranked_init(I, S, cap, iprm[7])
    ll_reset(I, 0, 1, E)
    ll_reset(I, 2, 3, E)
    ll_reset(I, 2, 3, E + 1)
    S[2], S[3], S[4], S[5] = iprm[0], 0, 0, 0
    G[0], G[1], G[2] = prm[0], prm[1], prm[2]
    R[0] = np.uint64(iprm[1])


@kernel
def forget(I, S, e):
    h = I[4, e]
    ll_unlink(I, 2, 3, e)
    S[3 + h] -= 1
    I[4, e] = 0


@kernel
def access(I, F, S, G, R, E, e):
    S[3] += 1
    ll_unlink(I, 0, 1, e)
    ll_append(I, 0, 1, E, e)
    F[K1, e] += 1.0
    I[K2, e] = S[3]
    ranked_rekey(I, F, S, e)


@kernel
def admit(I, F, S, G, R, E, e, prot):
    full = S[0] >= S[1]
    by_lru = ll_first_unprotected(I, 0, E, prot) if full else -1
    if full and by_lru < 0:
        return e
    S[3] += 1
    h = I[4, e]
    if h != 0:  # regret: the expert that evicted e loses weight against the other
        gain = math.exp(G[0] * G[1] ** float(S[3] - I[5, e]))
        forget(I, S, e)
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
                forget(I, S, I[2, E + expert - 1])
            ll_append(I, 2, 3, E + expert - 1, v)
            S[3 + expert] += 1
            I[4, v] = expert
            I[5, v] = S[3]
    ll_append(I, 0, 1, E, e)
    F[K1, e] = 1.0
    I[K2, e] = S[3]
    ranked_insert(I, F, S, e)
    return v


POLICY = Policy("lecar", init, admit, access, setup, ("learning_rate", "discount", "lru_weight", "seed"),
                summary="LRU and LFU mixed by regret (Vietri et al. 2018)")
