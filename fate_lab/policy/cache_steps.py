"""The one expert cache's layer steps, written once: run as Python by `ExpertCache`, compiled by the fast replay.

What this file is: `begin_a` and `begin_b` (a call starts: settle, recall, stale prefetches dropped, classify, the
lossy plan applied between the two, the compute order, the misses queued), `prefetch` and `prefetch_submit`,
`acquire`, `done` and `end`, over `cache_core.py`'s state and rules and in its form (read its docstring: the same
text runs interpreted and, after the ``body`` line below, compiled per policy by `sim/fast/dispatch.py`).
What it is not: the driver of the steps (`cache.py`; the replay's `sim/fast/driver.py`) or the mover.
"""
from __future__ import annotations

from fate_lab.policy.cache_core import (
    DROPPED,
    HASPRED,
    HOST,
    LOWP,
    MARKED,
    MISSING,
    NEED_STEAL,
    NO_PLAN,
    NSLOTS,
    NUSED,
    ON_HOST,
    PREFETCH,
    PREFILL_LOW,
    READY,
    STANDIN,
    SUBST,
    WAITING,
    cut,
    demand,
    drop,
    drop_stale,
    mv_cancel,
    mv_reload,
    mv_wait,
    njit,
    pol_access,
    promote,
    protect,
    push,
    reap,
    reserve,
    settle,
    submit,
    unstage,
)

# >>> body (sim/fast/dispatch.py copies what follows)


@njit(cache=True)
def begin_a(L, PZ, T, P, E, mv, needed, n, onhost, cls):
    """Layer call with the distinct experts needed[:n] starts: settle, recall of the prediction, prefetch
    outcomes, stale prefetches dropped; each expert classified into cls[i] (READY, ON_HOST, WAITING, MISSING).
    onhost[i] (None: never): a non-resident needed[i] computes on the host."""
    T.calls += 1
    if L.touched[0]:  # the last call never ended (interrupted): what it needed is no longer pending
        end(L)
    reap(PZ, mv, -1)
    settle(L, PZ, T, mv)
    # the needed set is marked only where something is compared with it (a prediction, prefetches, transfers in
    # flight, staged experts)
    L.sc[MARKED] = 1 if L.sc[HASPRED] or L.preflist[0] or L.inflist[0] or L.stlist[0] else 0
    if L.sc[MARKED]:
        for i in range(n):
            L.mark[needed[i]] = 1
    if L.sc[HASPRED]:  # recall / precision of the prediction made for this call
        npred = used = 0
        for i in range(1, L.pred[0] + 1):
            x = L.pred[i]
            if L.mark[x] < 2:
                npred += 1
                used += L.mark[x]
                L.mark[x] += 2
        for i in range(1, L.pred[0] + 1):
            L.mark[L.pred[i]] &= 1
        T.predictions += 1
        T.predicted += npred
        T.predicted_used += used
        T.true_used += n
    L.sc[HASPRED] = 0
    useful = 0
    for i in range(1, L.preflist[0] + 1):
        x = L.preflist[i]
        useful += L.mark[x]
        L.pref[x] = 0
    T.prefetch_useful += useful
    T.prefetch_wasted += L.preflist[0] - useful
    L.preflist[0] = 0
    drop_stale(L, PZ, mv)
    T.uses += n
    hits = 0
    for i in range(n):
        e = needed[i]
        if L.infl[e]:
            cls[i] = WAITING
            T.late += 1
        elif L.staged[e] >= 0 or L.valid[e]:
            cls[i] = READY
            hits += 1
            if L.where[e] >= 0:
                pol_access(P, E, e)
        else:
            T.misses += 1
            cls[i] = MISSING
            if onhost is None:
                pass
            elif onhost[i]:
                cls[i] = ON_HOST
                L.host[e] = 1
                T.host += 1
    T.hits += hits


@njit(cache=True)
def begin_b(L, PZ, T, P, E, mv, m, needed, n, cls, plan, order, cached):
    """The rest of the call's start, after the lossy plan (plan[i]: NO_PLAN, -1 drop, LOWP, or a stand-in; None:
    no plan): the compute order into order (returns its length), urgent prefetches, the misses queued."""
    if L.sc[MARKED]:
        for i in range(n):
            L.mark[needed[i]] = 0
        L.sc[MARKED] = 0
    L.deferred[0] = 0
    if plan is None:
        pass
    else:
        for i in range(n):
            if cls[i] != MISSING or plan[i] == NO_PLAN:
                continue
            e = needed[i]
            if plan[i] == -1:
                cls[i] = DROPPED
                T.dropped += 1
            elif plan[i] == LOWP:
                cls[i] = STANDIN
                L.lowp[e] = 1
                T.substituted += 1
            else:
                cls[i] = SUBST
                L.subst[e] = plan[i]
                T.substituted += 1
    k = 0  # stand-ins first (their slots are certain now), then resident: their compute hides the transfers
    for i in range(n):
        if cls[i] != READY:
            break
        order[i] = needed[i]
        k += 1
    ready = k == n
    present = 1 << READY if k else 0  # the classes present, one bit each
    if not ready:  # not every expert was ready: in that order, class by class
        for i in range(k, n):
            present |= 1 << cls[i]
        k = 0
        for c in (SUBST, READY, STANDIN, ON_HOST, WAITING, MISSING):
            if present >> c & 1:
                for i in range(n):
                    if cls[i] == c:
                        order[k] = needed[i]
                        k += 1
    for i in range(k):
        e = order[i]
        if not L.pend[e]:  # (a stand-in may come before, as the stand-in of an earlier miss)
            L.pend[e] = 1
            push(L.touched, e)
        f = L.subst[e]
        if f >= 0 and not L.pend[f]:
            L.pend[f] = 1
            push(L.touched, f)
    if ready:  # nothing to make urgent, nothing to queue
        return k
    if present >> WAITING & 1:  # a needed prefetch still queued becomes urgent: it goes before the misses
        for i in range(n):
            e = needed[i]
            if cls[i] == WAITING and not L.urg[e]:
                if mv is None:
                    ok = 0
                else:
                    ok = mv_cancel(mv, L.handle[e])
                if ok:
                    slot = L.staged[e] if L.staged[e] >= 0 else L.where[e]
                    submit(L, T, mv, m, e, slot, 1, L.reason[e])
    marked = False  # the protect row, marked once for the call's misses (what they protect changes only with them)
    for i in range(n):
        if cls[i] != MISSING:
            continue
        if not marked and L.sc[NUSED] >= L.sc[NSLOTS]:
            protect(L, 1)
            marked = True
        if not demand(L, PZ, T, P, E, mv, m, needed[i], cached, marked):
            push(L.deferred, needed[i])
    if marked:
        protect(L, 0)
    return k


@njit(cache=True)
def prefetch(L, PZ, P, E, predicted, cap, cached, on_use, moves):
    """Reserve slots for the predicted experts of this layer (most probable first) into moves[:k] (returned k):
    what is in flight or resident is skipped, at most cap (-1: no limit), and the first that finds no slot ends
    it. A prediction never evicts itself, nor what is in flight (marked in L.prot once the cache is full: with room
    no policy reads the row)."""
    marked = False
    k = 0
    for x in predicted:
        if L.infl[x] or L.valid[x] or L.staged[x] >= 0:
            continue
        if 0 <= cap <= k:
            break
        if not marked and L.sc[NUSED] >= L.sc[NSLOTS]:
            marked = True
            for i in range(1, L.inflist[0] + 1):
                L.prot[L.inflist[i]] = 1
            for y in predicted:
                L.prot[y] = 1
        if reserve(L, PZ, P, E, x, True, cached, on_use, True) < 0:
            break  # no slot left for prefetching this layer
        moves[k] = x
        k += 1
    if marked:
        for i in range(1, L.inflist[0] + 1):
            L.prot[L.inflist[i]] = 0
        for x in predicted:
            L.prot[x] = 0
    return k


@njit(cache=True)
def prefetch_submit(L, T, mv, m, moves, k, n_low):
    """Queue the k reserved prefetches (the last n_low of them at the low precision)."""
    for i in range(k):
        e = moves[i]
        slot = L.staged[e] if L.staged[e] >= 0 else L.where[e]
        submit(L, T, mv, m, e, slot, 0, PREFILL_LOW if i >= k - n_low else PREFETCH)
        if not L.pref[e]:
            L.pref[e] = 1
            push(L.preflist, e)
        T.prefetch_issued += 1


@njit(cache=True)
def acquire(L, PZ, T, P, E, mv, m, e, cached, retry):
    """The slot of e once its bytes are there (waits; reloads a failed transfer). NEED_STEAL: no slot could be
    made free in this layer; the caller frees other layers' staging slots and calls again with retry=1."""
    if L.host[e]:
        return HOST
    if L.lowp[e]:
        return LOWP
    f = L.subst[e]
    if f >= 0:
        return L.staged[f] if L.staged[f] >= 0 else L.where[f]
    if retry:
        if not demand(L, PZ, T, P, E, mv, m, e, cached, False):
            raise RuntimeError("no slot for an expert of this MoE layer (cache bug)")
    else:
        while L.deferred[0] and demand(L, PZ, T, P, E, mv, m, L.deferred[1], cached, False):
            cut(L.deferred, 1)  # slots freed by computed experts
        if L.deferred[0] and L.deferred[1] == e:  # e is next and still has no slot: make one free
            cut(L.deferred, 1)
            if not demand(L, PZ, T, P, E, mv, m, e, cached, False):
                reap(PZ, mv, m)
                return NEED_STEAL
    slot = L.staged[e] if L.staged[e] >= 0 else L.where[e]
    if L.infl[e]:
        if mv is None:
            ok = 1
        else:
            ok = mv_wait(mv, m, e, L.handle[e])
        L.infl[e] = 0  # only now: a wait left by Ctrl-C keeps it in flight for the next call
        drop(L.inflist, e)
        if not ok:
            T.failures += 1
            if mv is None:
                pass
            else:
                mv_reload(mv, m, e, slot, L.reason[e])
    if L.where[e] >= 0:
        L.valid[e] = 1
    return slot


@njit(cache=True)
def done(L, PZ, P, E, e, promote_ok):
    """e has computed: its staging slot is given back, or (promote_ok: admit on use) it joins the cache."""
    L.pend[e] = 0
    L.host[e] = 0
    if L.staged[e] >= 0 and not L.infl[e]:
        if promote_ok:
            promote(L, PZ, P, E, e)
        else:
            unstage(L, PZ, e)


@njit(cache=True)
def end(L):
    """The call is over: what it needed, hosted or stood in for is forgotten."""
    for i in range(1, L.touched[0] + 1):
        x = L.touched[i]
        L.pend[x] = 0
        L.host[x] = 0
        L.lowp[x] = 0
        L.subst[x] = -1
    L.touched[0] = 0
