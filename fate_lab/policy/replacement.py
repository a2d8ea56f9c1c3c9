"""Per-layer expert-cache replacement policies: pure bookkeeping over expert ids.

A policy answers one question, "which resident expert goes?". It holds no weights, touches
no device and no thread; the runtime's slot manager and the trace replay (`fate_lab.sim.replay`)
drive the same objects. One policy instance manages the cache of ONE MoE layer.

Contract shared by every policy (the replay and the runtime rely on it):

- ``admit(e)`` inserts a non-resident expert and counts as its first reference (an on-demand
  load or a prefetch); ``access(e)`` is a further use of a resident expert.
- ``admit`` never evicts an id in ``protect`` (the experts the current token still needs).
  If nothing can be evicted (capacity 0, or every resident id is protected) it returns ``e``
  itself, meaning "not cached": the caller uses the expert from a transient buffer.
- ``admit`` of an already-resident id is treated as ``access`` and returns None.
- A policy with ``wants_scores = True`` also gets ``observe(probs, n_tokens)`` once per experts
  call, BEFORE its accesses: the router's probability of every expert of its layer, averaged over
  the call's n tokens (the drivers compute it from the gate input, as the predictor does).

This module holds the interface and the classic policies (LRU, LFU, ARC, Belady's bound);
`replacement_scored.py` the frequency/score-weighted ones (LRFU, RouterEMA), `replacement_field.py` the
policies of the caching field, and `registry.py` builds any of them by name.
This module is not the slot manager: it never decides *when* to load, only *what* to drop.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Iterable, Sequence


class ReplacementPolicy:
    """Interface of a per-layer cache policy over expert ids (see the module docstring)."""

    name = "base"
    capacity: int
    wants_scores = False  # True: the drivers call observe() with the router's probabilities

    def observe(self, probs: Sequence[float], n_tokens: int = 1) -> None:
        """The router's probabilities of this layer's E experts, averaged over a call's n tokens."""

    def __contains__(self, e: int) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.resident())

    def resident(self) -> list[int]:  # pragma: no cover - interface
        """Resident expert ids (order is policy-specific: eviction candidates first)."""
        raise NotImplementedError

    def access(self, e: int) -> None:  # pragma: no cover - interface
        """Record a use of the resident expert ``e``."""
        raise NotImplementedError

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:  # pragma: no cover
        """Insert non-resident ``e``; return the evicted id, None, or ``e`` if not cached."""
        raise NotImplementedError


class ScoredEviction(ReplacementPolicy):
    """A policy that evicts the unprotected resident ranked lowest by `_rank` (one admit for LRFU, RouterEMA and
    LeastStale): a subclass keeps `_res` and `capacity`, defines `_rank(e)` (lowest goes first) and `access(e)`
    (a use; also called on insert), and may drop an evicted expert's history in `_forget(e)`."""

    _res: set[int]

    def _rank(self, e: int):  # pragma: no cover - interface
        raise NotImplementedError

    def _forget(self, e: int) -> None:
        """An evicted expert's bookkeeping, dropped or kept (default: kept)."""

    def __contains__(self, e: int) -> bool:
        return e in self._res

    def resident(self) -> list[int]:
        """Resident ids, next victim first."""
        return sorted(self._res, key=self._rank)

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:
        """Insert ``e``; evict the unprotected resident ranked lowest."""
        if e in self._res:
            self.access(e)
            return None
        victim = None
        if len(self._res) >= self.capacity:
            candidates = [x for x in self._res if x not in protect] if protect else self._res
            if not candidates:
                return e
            victim = min(candidates, key=self._rank)
            self._res.discard(victim)
            self._forget(victim)
        self._res.add(e)
        self.access(e)
        return victim


def check_capacity(capacity: int) -> int:
    """The capacity as an int, refusing a negative one."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 expert slots, got {capacity}")
    return int(capacity)


class LRU(ReplacementPolicy):
    """Least recently used: evict the resident expert whose last reference is oldest."""

    name = "lru"

    def __init__(self, capacity: int):
        self.capacity = check_capacity(capacity)
        self._od: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __contains__(self, e: int) -> bool:
        return e in self._od

    def resident(self) -> list[int]:
        """Resident ids, least recently used first."""
        return list(self._od)

    def access(self, e: int) -> None:
        """Move ``e`` to the most-recent end."""
        self._od.move_to_end(e)

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:
        """Insert ``e`` as most recent, evicting the oldest unprotected resident if full."""
        od = self._od
        if e in od:
            od.move_to_end(e)
            return None
        if len(od) < self.capacity:
            od[e] = None
            return None
        for victim in od:
            if victim not in protect:
                break
        else:  # capacity 0 or everything protected
            return e
        del od[victim]
        od[e] = None
        return victim


class LFU(ReplacementPolicy):
    """Least frequently used, ties broken by least recent use.

    ``keep_history=True`` ("perfect LFU") keeps an expert's count after eviction, which suits
    expert popularity (stable over a session); False resets it on eviction ("in-cache LFU").
    """

    name = "lfu"

    def __init__(self, capacity: int, keep_history: bool = True):
        self.capacity = check_capacity(capacity)
        self.keep_history = keep_history
        self._count: dict[int, int] = {}
        self._last: dict[int, int] = {}  # resident id -> time of last reference
        self._t = 0

    def __contains__(self, e: int) -> bool:
        return e in self._last

    def resident(self) -> list[int]:
        """Resident ids, next victim first."""
        return sorted(self._last, key=lambda x: (self._count.get(x, 0), self._last[x]))

    def _ref(self, e: int) -> None:
        self._t += 1
        self._count[e] = self._count.get(e, 0) + 1
        self._last[e] = self._t

    def access(self, e: int) -> None:
        """Count one more use of ``e``."""
        self._ref(e)

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:
        """Insert ``e``; evict the unprotected resident with the lowest (count, last use)."""
        if e in self._last:
            self._ref(e)
            return None
        victim = None
        if len(self._last) >= self.capacity:
            best = None
            for x, last in self._last.items():
                if x in protect:
                    continue
                key = (self._count.get(x, 0), last)
                if best is None or key < best:
                    best, victim = key, x
            if victim is None:
                return e
            del self._last[victim]
            if not self.keep_history:
                self._count.pop(victim, None)
        self._ref(e)
        return victim


class ARC(ReplacementPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), as in Fate's reference code.

    T1 holds ids referenced once recently, T2 ids referenced at least twice; B1/B2 are ghost
    lists of ids evicted from T1/T2. ``p`` is the adaptive target size of T1: a ghost hit in
    B1 grows it, a ghost hit in B2 shrinks it. ``admit`` is ARC's miss path (cases II–IV),
    ``access`` its hit path (case I).
    """

    name = "arc"

    def __init__(self, capacity: int):
        self.capacity = check_capacity(capacity)
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, e: int) -> bool:
        return e in self.t1 or e in self.t2

    def resident(self) -> list[int]:
        """Resident ids: T1 (LRU first) then T2 (LRU first)."""
        return list(self.t1) + list(self.t2)

    def access(self, e: int) -> None:
        """Case I: a hit moves ``e`` to the MRU end of T2."""
        if e in self.t1:
            del self.t1[e]
        else:
            del self.t2[e]
        self.t2[e] = None

    @staticmethod
    def _lru_unprotected(od: OrderedDict, protect: frozenset[int]) -> int | None:
        for x in od:
            if x not in protect:
                return x
        return None

    def _replace(self, in_b2: bool, protect: frozenset[int]) -> int | None:
        """ARC's REPLACE: demote the LRU of T1 (to B1) or of T2 (to B2); None if all protected."""
        n1 = len(self.t1)
        prefer_t1 = n1 > 0 and (n1 > self.p or (in_b2 and n1 == self.p))
        order = ((self.t1, self.b1), (self.t2, self.b2))
        if not prefer_t1:
            order = order[::-1]
        for src, ghost in order:
            victim = self._lru_unprotected(src, protect)
            if victim is not None:
                del src[victim]
                ghost[victim] = None
                return victim
        return None

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:
        """Miss path: ghost hits adapt ``p``; evict per REPLACE; return the evicted id."""
        c = self.capacity
        if e in self.t1 or e in self.t2:
            self.access(e)
            return None
        if c == 0:
            return e
        full = len(self.t1) + len(self.t2) >= c
        victim = None
        if e in self.b1:  # case II: recency was under-provisioned
            delta = max(len(self.b2) / len(self.b1), 1.0)
            p0, self.p = self.p, min(float(c), self.p + delta)  # the paper adapts p before REPLACE
            if full:
                victim = self._replace(False, protect)
                if victim is None:
                    self.p = p0  # nothing admitted: nothing changes
                    return e
            del self.b1[e]
            self.t2[e] = None
            return victim
        if e in self.b2:  # case III: frequency was under-provisioned
            delta = max(len(self.b1) / len(self.b2), 1.0)
            p0, self.p = self.p, max(0.0, self.p - delta)
            if full:
                victim = self._replace(True, protect)
                if victim is None:
                    self.p = p0
                    return e
            del self.b2[e]
            self.t2[e] = None
            return victim
        # case IV: a brand-new id
        l1 = len(self.t1) + len(self.b1)
        total = l1 + len(self.t2) + len(self.b2)
        if l1 >= c:
            if len(self.t1) < c:
                if full:
                    victim = self._replace(False, protect)
                    if victim is None:
                        return e
                self.b1.popitem(last=False)
            else:  # B1 empty, T1 is the whole cache: drop T1's LRU without a ghost
                victim = self._lru_unprotected(self.t1, protect)
                if victim is None:
                    return e
                del self.t1[victim]
        elif total >= c:
            if full:
                victim = self._replace(False, protect)
                if victim is None:
                    return e
            if len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c and self.b2:
                self.b2.popitem(last=False)
        self.t1[e] = None
        return victim


class Belady(ReplacementPolicy):
    """Belady's MIN: evict the resident expert whose next use is furthest in the future.

    Replay only: ``future[t]`` lists the experts this layer uses at token ``t``; the driver
    calls ``at(t)`` before token ``t``. With no prefetching it is the miss-count lower bound
    (for the same protect rule) that other policies are measured against.
    """

    name = "belady"

    def __init__(self, capacity: int, future: Sequence[Iterable[int]]):
        self.capacity = check_capacity(capacity)
        self._uses: dict[int, list[int]] = {}
        for t, es in enumerate(future):
            for e in es:
                lst = self._uses.setdefault(int(e), [])
                if not lst or lst[-1] != t:
                    lst.append(t)
        self._res: set[int] = set()
        self.now = 0

    def at(self, t: int) -> None:
        """Set the current token index."""
        self.now = t

    def next_use(self, e: int) -> float:
        """First token index >= now at which ``e`` is used (inf if never)."""
        lst = self._uses.get(e)
        if not lst:
            return float("inf")
        i = bisect.bisect_left(lst, self.now)
        return lst[i] if i < len(lst) else float("inf")

    def __contains__(self, e: int) -> bool:
        return e in self._res

    def resident(self) -> list[int]:
        """Resident ids, furthest next use first."""
        return sorted(self._res, key=lambda x: (-self.next_use(x), x))

    def access(self, e: int) -> None:
        """Nothing to record: the future is already known."""

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:
        """Insert ``e``, evicting the unprotected resident used furthest in the future."""
        if e in self._res:
            return None
        victim = None
        if len(self._res) >= self.capacity:
            best = None
            for x in self._res:
                if x in protect:
                    continue
                key = (self.next_use(x), -x)  # ties: the smallest id goes
                if best is None or key > best:
                    best, victim = key, x
            if victim is None:
                return e
            self._res.discard(victim)
        self._res.add(e)
        return victim
