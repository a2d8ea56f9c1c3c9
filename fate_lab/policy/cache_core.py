"""The one expert cache's state machine, written once and run two ways: interpreted by `ExpertCache`, compiled by
the fast replay.

What this file is: the state of one MoE layer (`Lay`) and of the staging pools every layer shares (`Pools`), and
the rules the layer steps share (`reserve`, `promote`, `release`, `submit`, `demand`, `settle`, `reap`,
`drop_stale`) as plain functions over that state; the steps themselves (`begin_a`/`begin_b`, `prefetch`,
`acquire`, `done`, `end`) are `cache_steps.py`, written the same way. The semantics are `cache.py`'s docstring.
- Interpreted (this module, imported as it is): `cache.ExpertCache` keeps the state in Python lists (an element
  costs what a dict look-up costs), drives the mover between the steps, and counts into `stats.PhaseStats`.
- Compiled (`sim/fast/dispatch.py`): the block between the two ``mode`` lines below is replaced by numba's `njit`
  and the policy's compiled functions, and the file is compiled per policy with `cache_steps.py` and
  `sim/fast/driver.py`'s token loop after it. The state is numpy arrays and typed lists, the counters a numpy
  record, and the mover is None: the replay's instant link (every transfer has landed when it is queued, nothing
  can be cancelled).
So the code below uses only what both agree on: indexing, attribute counts, and a mover reached only in branches
on ``mv is None`` (numba prunes them when the mover is None). A list is a row whose element 0 holds its length and
1.. its items (`push`, `cut`, `drop`): no allocation, so the compiled code needs no reference counting, which
would otherwise cost more than the cache's work (a typed list in the state made the loop 20x slower).
Python-only inputs (the host placement, a lossy miss plan, a low-precision count) come in as flags computed
before the step, or None. What it is not: the mover, the multi-layer bookkeeping (stealing staging slots from
other layers, the slot audit: `cache.py`), or a policy.
"""
from __future__ import annotations

from typing import NamedTuple

from fate_lab.policy.lossy import LOWP  # noqa: F401 -- the "slot" of a miss computed from its low-precision copy

HOST = -1  # the "slot" of an expert that computes on the host
NEED_STEAL = -10  # acquire: no slot anywhere; the caller frees other layers' staging slots and calls again
MISS, PREFETCH, PREFILL_LOW, FILL, PREFETCH_LOW = 0, 1, 2, 3, 4  # why a transfer moves (`REASONS` names them)
REASONS = ("miss", "prefetch", "prefill_low", "fill", "prefetch_low")
READY, ON_HOST, WAITING, MISSING, DROPPED, STANDIN, SUBST = 0, 1, 2, 3, 4, 5, 6  # begin's classes of an expert
NO_PLAN = -4  # a miss the lossy plan leaves alone (loaded)
NUSED, HASPRED, NSLOTS, PARITY, MARKED = 0, 1, 2, 3, 4  # Lay.sc: cache slots in use, prediction kept, cache slots,
# m % 2, the call's needed experts marked (Lay.mark)


class Lay(NamedTuple):
    """One MoE layer's state. Per expert id: where (its cache slot, -1), staged (its staging slot, -1), valid,
    infl (a transfer in flight), urg and reason (of that transfer), pref (prefetched for the next call), pend (the
    current call still needs it), host, lowp, subst (its stand-in, -1), mark (scratch), handle (the mover's)."""

    where: object
    staged: object
    valid: object
    infl: object
    urg: object
    reason: object
    pref: object
    pend: object
    host: object
    lowp: object
    subst: object
    mark: object
    handle: object
    prot: object  # uint8 [E + 8]: the protect row a policy's admit reads (marked around the admit)
    inflist: object  # (a list: element 0 its length) ids in flight, in the order they were queued
    stlist: object  # (a list) staged ids, in the order they were staged
    preflist: object  # (a list) prefetched ids
    deferred: object  # (a list) misses still waiting for a slot
    pred: object  # (a list) the prediction kept for the next call (recall)
    touched: object  # (a list) this call's experts and stand-ins (cleared by end)
    cslots: object  # the cache slots this layer owns; the first sc[NUSED] are reserved
    sc: object  # scalars (NUSED, HASPRED, NSLOTS, PARITY, MARKED)


class Pools(NamedTuple):
    """The staging slots every layer shares: pool 0 on-demand loads, pools 1 and 2 the prefetches of even and odd
    layers (free stacks pfree[p][:pn[p]]); pool_of[slot] (-1: a cache slot); zombies: staging slots whose
    unneeded transfer still runs (zslots, a list; their handles at the same places of zhand)."""

    pfree: object
    pn: object
    pool_of: object
    zslots: object
    zhand: object


# >>> mode: interpreted (sim/fast/dispatch.py replaces the lines up to the closing mode line in a compiled copy)
def njit(*args, **kw):
    """No compiler here: the functions below run as Python."""
    return args[0] if args and callable(args[0]) else (lambda f: f)


def pol_admit(P, E, e, prot):
    return P.admit_row(e, prot)


def pol_access(P, E, e):
    P.access(e)


def mv_submit(mv, m, e, slot, urgent, reason):
    return mv.submit(m, e, slot, bool(urgent), REASONS[reason])


def mv_poll(mv, h):
    r = mv.poll(h)
    return -1 if r is None else (1 if r else 0)


def mv_cancel(mv, h):
    return 1 if mv.cancel(h) else 0


def mv_wait(mv, m, e, h):
    return 1 if mv.wait(m, e, h) else 0


def mv_reload(mv, m, e, slot, reason):
    mv.reload(m, e, slot, REASONS[reason])
# <<< mode


@njit(cache=True)
def push(a, x):
    """Append x to the list a."""
    n = a[0] + 1
    a[n] = x
    a[0] = n


@njit(cache=True)
def cut(a, i):
    """Remove the item at place i (1..a[0]) of the list a, keeping the order."""
    n = a[0]
    for j in range(i, n):
        a[j] = a[j + 1]
    a[0] = n - 1


@njit(cache=True)
def drop(a, x):
    """Remove x from the list a (it is there)."""
    for i in range(1, a[0] + 1):
        if a[i] == x:
            cut(a, i)
            return


@njit(cache=True)
def release(PZ, slot):
    """Give a staging slot back to its pool."""
    p = PZ.pool_of[slot]
    PZ.pfree[p][PZ.pn[p]] = slot
    PZ.pn[p] += 1


@njit(cache=True)
def unstage(L, PZ, e):
    """Staged e leaves its staging slot (given back)."""
    release(PZ, L.staged[e])
    L.staged[e] = -1
    drop(L.stlist, e)


@njit(cache=True)
def take_staging(PZ, parity, for_prefetch):
    """A free staging slot (-1: none): prefetches use their layer's pool, on-demand loads the demand pool first."""
    for p in (0, 1 + parity):
        if p == 0 and for_prefetch:
            continue
        if PZ.pn[p] > 0:
            PZ.pn[p] -= 1
            return PZ.pfree[p][PZ.pn[p]]
    return -1


@njit(cache=True)
def protect(L, v):
    """Mark (v=1) or clear (v=0) the experts the current call still needs and those in flight in L.prot."""
    for i in range(1, L.touched[0] + 1):
        x = L.touched[i]
        if L.pend[x]:
            L.prot[x] = v
    for i in range(1, L.inflist[0] + 1):
        L.prot[L.inflist[i]] = v


@njit(cache=True)
def admit(L, P, E, e, marked):
    """The policy's admit of e protecting what the call needs and what is in flight (`marked`: the caller has
    marked L.prot already). With room no policy reads the row (kernels/record.py), so none is marked then."""
    if marked or L.sc[NUSED] < L.sc[NSLOTS]:
        return pol_admit(P, E, e, L.prot)
    protect(L, 1)
    v = pol_admit(P, E, e, L.prot)
    protect(L, 0)
    return v


@njit(cache=True)
def reserve(L, PZ, P, E, e, for_prefetch, cached, on_use, marked):
    """A slot for e from the layer's cache or from staging; -1 if there is none now."""
    if L.where[e] >= 0:  # reserved earlier but its bytes never arrived (dropped or failed)
        pol_access(P, E, e)
        return L.where[e]
    if cached and L.sc[NSLOTS] > 0 and not (for_prefetch and on_use):
        v = admit(L, P, E, e, marked)
        if v != e:
            if v < 0:
                slot = L.cslots[L.sc[NUSED]]
                L.sc[NUSED] += 1
            else:
                slot = L.where[v]
                L.where[v] = -1
                L.valid[v] = 0
            L.where[e] = slot
            return slot
    slot = take_staging(PZ, L.sc[PARITY], for_prefetch)
    if slot >= 0:
        L.staged[e] = slot
        push(L.stlist, e)
    return slot


@njit(cache=True)
def promote(L, PZ, P, E, e):
    """A staged expert that was just used joins the layer's cache; slots swap owners, no bytes move."""
    slot = L.staged[e]
    L.staged[e] = -1
    drop(L.stlist, e)
    v = admit(L, P, E, e, False)
    if v == e:  # nothing may be evicted: it stays uncached
        release(PZ, slot)
        return
    if v < 0:
        i = L.sc[NUSED]
        L.sc[NUSED] += 1
    else:
        freed = L.where[v]
        L.where[v] = -1
        L.valid[v] = 0
        i = 0
        while L.cslots[i] != freed:
            i += 1
    freed = L.cslots[i]
    p = PZ.pool_of[slot]
    L.cslots[i] = slot
    PZ.pool_of[slot] = -1
    PZ.pool_of[freed] = p
    release(PZ, freed)
    L.where[e] = slot
    L.valid[e] = 1


@njit(cache=True)
def submit(L, T, mv, m, e, slot, urgent, reason):
    """Queue the transfer of e into slot (a later submit of e replaces the one in flight, keeping its place)."""
    if mv is None:
        h = 0
        T.bytes_moved += 1  # the instant link: one expert moved (scaled to bytes by the replay)
    else:
        h = mv_submit(mv, m, e, slot, urgent, reason)
    if not L.infl[e]:
        L.infl[e] = 1
        push(L.inflist, e)
    L.urg[e] = urgent
    L.reason[e] = reason
    L.handle[e] = h


@njit(cache=True)
def demand(L, PZ, T, P, E, mv, m, e, cached, marked):
    """Queue an urgent load of e; False if no slot is free now (`marked`: the caller has marked L.prot)."""
    slot = reserve(L, PZ, P, E, e, False, cached, False, marked)
    if slot < 0:
        return False
    submit(L, T, mv, m, e, slot, 1, MISS)
    return True


@njit(cache=True)
def settle(L, PZ, T, mv):
    """Absorb the layer's finished transfers without waiting."""
    i = 1
    while i <= L.inflist[0]:
        e = L.inflist[i]
        if mv is None:
            ok = 1
        else:
            ok = mv_poll(mv, L.handle[e])
        if ok < 0:
            i += 1
            continue
        cut(L.inflist, i)
        L.infl[e] = 0
        if ok == 1:
            if L.where[e] >= 0:
                L.valid[e] = 1
        else:  # a failed transfer: counted; a staged one gives its slot back
            T.failures += 1
            if L.staged[e] >= 0:
                unstage(L, PZ, e)


@njit(cache=True)
def reap(PZ, mv, wait_in):
    """Give back the staging slots of unneeded transfers that have finished (or, from layer wait_in >= 0's call,
    wait for them: that wait is the layer's stall)."""
    j = 1
    for i in range(1, PZ.zslots[0] + 1):
        if mv is None:
            ok = 1
        else:
            h = PZ.zhand[i]
            if wait_in >= 0 and mv_poll(mv, h) < 0:
                mv_wait(mv, wait_in, -1, h)
            ok = mv_poll(mv, h)
        if ok >= 0:
            release(PZ, PZ.zslots[i])
        else:
            PZ.zslots[j] = PZ.zslots[i]
            if mv is not None:
                PZ.zhand[j] = PZ.zhand[i]
            j += 1
    PZ.zslots[0] = j - 1


@njit(cache=True)
def drop_stale(L, PZ, mv):
    """Queued prefetches the call does not need (unmarked) are cancelled; unneeded staged experts leave."""
    i = 1
    while i <= L.inflist[0]:
        e = L.inflist[i]
        if L.mark[e]:
            i += 1
            continue
        if mv is None:
            ok = 0
        else:
            ok = mv_cancel(mv, L.handle[e])
        if ok:
            cut(L.inflist, i)
            L.infl[e] = 0
            if L.staged[e] >= 0:
                unstage(L, PZ, e)
        elif L.staged[e] >= 0:  # already on the link: its slot comes back when it lands
            cut(L.inflist, i)
            L.infl[e] = 0
            push(PZ.zslots, L.staged[e])
            if mv is not None:
                PZ.zhand[PZ.zslots[0]] = L.handle[e]
            L.staged[e] = -1
            drop(L.stlist, e)
        else:  # into a cache slot and already on the link: it stays in flight (never evicted) and lands valid
            i += 1
    i = 1
    while i <= L.stlist[0]:
        e = L.stlist[i]
        if L.mark[e]:
            i += 1
        else:
            unstage(L, PZ, e)


