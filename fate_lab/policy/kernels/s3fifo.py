"""S3-FIFO (Yang et al., SOSP 2023): a small FIFO that filters one-hit ids, a main FIFO with reinsertion, a ghost
FIFO of ids evicted from the small one.

Keywords: ``small_ratio`` (the small FIFO's share of the slots, 0.1), ``ghost_ratio`` (the ghost FIFO's length per
slot, 0.9), ``move_threshold`` (hits in the small FIFO that promote an id to main, 2). State: queues small, main,
ghost (codes 1-3, sentinels E..E+2, lengths S[11..13]) in rows 0-1 of I, I[2] the queue of each id, I[3] its hits;
S[4] small share, S[5] main share, S[6] ghost length, S[7] threshold, S[8] 1 once anything was evicted.
"""
from __future__ import annotations

from fate_lab.policy.kernels.blocks import ll_first_unprotected, ll_move, ll_reset
from fate_lab.policy.kernels.record import Policy, kernel, ratio


def setup(capacity: int, small_ratio: float = 0.1, ghost_ratio: float = 0.9,
          move_threshold: int = 2) -> tuple[list[float], list[int]]:
    if move_threshold < 1:
        raise ValueError(f"move_threshold must be >= 1 hit, got {move_threshold}")
    small = int(capacity * ratio("small_ratio", small_ratio))
    return [], [small, int(capacity * ratio("ghost_ratio", ghost_ratio)), int(move_threshold)]


@kernel
def init(I, F, S, G, R, E, cap, prm, iprm, uses):
    for c in range(3):
        ll_reset(I, 0, 1, E + c)
        S[11 + c] = 0
    S[1], S[4], S[5], S[6], S[7], S[8] = cap, iprm[0], cap - iprm[0], iprm[1], iprm[2], 0


@kernel
def put(I, S, E, e, code):
    """Move e to the new end of queue `code` (0: out of every queue)."""
    ll_move(I, S, E, e, code, 10)


@kernel
def evict_small(I, S, E, prot):
    x = I[0, E]
    while x != E:
        nxt = I[0, x]
        if not prot[x]:
            if I[3, x] >= S[7]:
                put(I, S, E, x, 2)
                I[3, x] = 0
            else:
                put(I, S, E, x, 0)
                if S[6] > 0:
                    if S[13] >= S[6]:
                        put(I, S, E, I[0, E + 2], 0)
                    put(I, S, E, x, 3)
                return x
        x = nxt
    return -1


@kernel
def evict_main(I, S, E, prot):
    while True:
        seen = False
        x = I[0, E + 1]
        for _ in range(S[12]):
            nxt = I[0, x]
            if not prot[x]:
                seen = True
                f = I[3, x]
                if f == 0:
                    put(I, S, E, x, 0)
                    return x
                put(I, S, E, x, 2)  # reinserted at the new end
                I[3, x] = min(f, 3) - 1
            x = nxt
        if not seen:
            return -1


@kernel
def admit(I, F, S, G, R, E, e, prot):
    full = S[11] + S[12] >= S[1]
    if full and ll_first_unprotected(I, 0, E, prot) < 0 and ll_first_unprotected(I, 0, E + 1, prot) < 0:
        return e
    ghost_hit = I[2, e] == 3
    if ghost_hit:
        put(I, S, E, e, 0)
    v = -1
    if full:
        S[8] = 1
        if S[12] > S[5] or S[11] == 0:
            v = evict_main(I, S, E, prot)
            if v < 0:
                v = evict_small(I, S, E, prot)
        else:
            v = evict_small(I, S, E, prot)
            if v < 0:
                v = evict_main(I, S, E, prot)
    put(I, S, E, e, 2 if ghost_hit or (S[8] == 0 and S[11] >= S[4]) else 1)
    I[3, e] = 0
    return v


@kernel
def access(I, F, S, G, R, E, e):
    I[3, e] += 1


POLICY = Policy("s3fifo", init, admit, access, setup, ("small_ratio", "ghost_ratio", "move_threshold"),
                summary="S3-FIFO (Yang et al. 2023)")
