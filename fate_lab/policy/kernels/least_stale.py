"""Least-stale, a policy made for MoE experts, after SpecMD (Hoang et al., 2026, arXiv 2602.03921).

Our reading, stated because the public description is thin: SpecMD's abstract says only that Least-Stale "exploits
MoE's predictable expert access patterns". We read "stale" against each expert's own rhythm: every expert learns its
reuse interval as it is used (an exponential average, weight ``alpha`` on the newest interval, seeded by the first
one; a new expert counts 1); its staleness is the time since its last use over that interval, and the stalest
resident goes. With every interval 1 this is LRU. Time counts the uses made to this layer's cache; ties evict the
least recently used. ``keep_history=True`` keeps an evicted expert's interval for its return. Two public
re-implementations read it as "evict the resident whose predicted next use is furthest"; on the embedded models'
traces that reading loses to LRU by 6-20 points of decode hit rate, so we do not follow it.
State: I[0] last use, I[1] has a record, F[0] the learned interval; the residents in the ranked array (never a heap:
staleness changes with time), scanned on eviction; S[2] the time, S[3] keep_history; G[0] alpha.
"""
from __future__ import annotations

from fate_lab.policy.kernels.blocks import HEAP, ranked_init, ranked_insert, ranked_remove
from fate_lab.policy.kernels.record import Policy, kernel


def setup(capacity: int, alpha: float = 0.25, keep_history: bool = False) -> tuple[list[float], list[int]]:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    return [float(alpha)], [int(bool(keep_history))]


@kernel
def init(I, F, S, G, R, E, cap, prm, iprm, uses):
    ranked_init(I, S, cap, cap)  # always the scanned array
    S[3] = iprm[0]
    G[0] = prm[0]


@kernel
def access(I, F, S, G, R, E, e):
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


@kernel
def admit(I, F, S, G, R, E, e, prot):
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
    access(I, F, S, G, R, E, e)
    ranked_insert(I, F, S, e)
    return v


POLICY = Policy("least_stale", init, admit, access, setup, ("alpha", "keep_history"),
                kind="moe", summary="the expert most overdue for its own reuse interval goes (after SpecMD)")
