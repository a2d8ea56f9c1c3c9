"""The reference policies: the first, pure-Python versions of every replacement policy, kept as the independent
reference the compiled ones (fate_lab/policy/kernels/) are checked against, victim for victim.

They were the package's policies until the compiled ones replaced them; hand examples in test_replacement*.py pin
them to the papers, and tests/policy/test_compiled_policies.py drives each compiled policy and its reference with
the same random admits, uses and protect sets. A CLOCK reference is written here in the textbook form.
"""
from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from typing import Iterable, Sequence

from fate_lab.policy.replacement import ReplacementPolicy, check_capacity


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


class LRFU(ScoredEviction):
    """Frequency-weighted recency (LRFU, Lee et al. 2001): our better-than-LRU policy.

    Each reference adds 1 to an expert's combined recency-frequency score, and the score
    decays by ``2 ** (-lam)`` per reference made to this layer's cache. ``lam -> 0`` is LFU,
    large ``lam`` is LRU. Scores are kept after eviction (``keep_history``), so an expert that
    is popular over the session but briefly idle beats one used once a moment ago — the
    failure mode of LRU on skewed expert popularity. Eviction scans the residents (at most E).
    The default ``lam = 0.01`` (half-life 100 references, ~25 tokens at top-4) beat LRU, ARC
    and LFU on a synthetic trace with drifting popularity and token-to-token locality, and
    stayed within ~2 points of LFU on a stationary one; tune it on a real trace.
    """

    name = "lrfu"

    def __init__(self, capacity: int, lam: float = 0.01, keep_history: bool = True):
        self.capacity = check_capacity(capacity)
        if lam < 0:
            raise ValueError(f"lam must be >= 0, got {lam}")
        self.lam = lam
        self.keep_history = keep_history
        self._decay = 2.0 ** (-lam)
        self._crf: dict[int, float] = {}  # score as of time _tref[e]
        self._tref: dict[int, int] = {}
        self._key: dict[int, tuple[float, int]] = {}  # log2(score) + lam * t, shifted by a common term
        self._res: set[int] = set()
        self._t = 0

    def score(self, e: int) -> float:
        """Current combined recency-frequency score of ``e``."""
        if e not in self._crf:
            return 0.0
        return self._crf[e] * self._decay ** (self._t - self._tref[e])

    def _ref(self, e: int) -> None:
        self._t += 1
        crf = 1.0 + self.score(e)
        self._crf[e], self._tref[e] = crf, self._t
        # score(e) at any later time t is 2**(key - lam * t): comparing keys compares scores
        self._key[e] = (math.log2(crf) + self.lam * self._t, self._t)

    def _rank(self, e: int) -> tuple[float, int]:
        return self._key[e]  # lowest score (next victim) first

    def access(self, e: int) -> None:
        """Add one reference to ``e``'s score."""
        self._ref(e)

    def _forget(self, e: int) -> None:
        if not self.keep_history:
            del self._crf[e], self._tref[e], self._key[e]


class RouterEMA(ScoredEviction):
    """Soft frequency from the router itself: evict the resident expert with the lowest decayed
    average of the router's probability (our policy beyond ARC).

    LRU, ARC and LRFU see only the top-k experts each token picked; the router's full distribution
    also says which experts came close. Each token decays every score by ``decay`` and adds
    ``(1 - decay) x p(e)``; a call of n tokens with mean probabilities p does it n times at once
    (``decay ** n``). Ties go to the least recently used. ``decay=0.9`` (about a 10-token memory)
    is the best of 0.5-0.98 on the embedded tiny_moe's calibration trace at 25% cached, and 0.3 points
    behind 0.95 at 50% (benchmarks/results/replacement_2026-12-03.md).
    """

    name = "router_ema"
    wants_scores = True

    def __init__(self, capacity: int, decay: float = 0.9):
        self.capacity = check_capacity(capacity)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._score: list[float] = []
        self._last: dict[int, int] = {}
        self._res: set[int] = set()
        self._t = 0

    def observe(self, probs: Sequence[float], n_tokens: int = 1) -> None:
        """Decay every score n_tokens times and add the call's mean probabilities."""
        d = self.decay ** max(1, n_tokens)
        if not self._score:
            self._score = [0.0] * len(probs)
        self._score = [d * a + (1.0 - d) * b for a, b in zip(self._score, probs, strict=False)]

    def _rank(self, e: int) -> tuple[float, int]:
        """Lowest score (next victim) first; ties: the least recently used."""
        return (self._score[e] if e < len(self._score) else 0.0, self._last.get(e, -1))

    def access(self, e: int) -> None:
        """A use: only the recency (tie-break) changes; the score follows the router."""
        self._t += 1
        self._last[e] = self._t


MASK64 = (1 << 64) - 1


def splitmix64(state: int) -> tuple[int, float]:
    """One step of SplitMix64: (next state, a uniform float in [0, 1)); the fast path uses the same."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return state, (z >> 11) * (1.0 / (1 << 53))


def _ratio(name: str, value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


def all_protected(resident, protect: frozenset[int]) -> bool:
    return all(x in protect for x in resident)


class S3FIFO(ReplacementPolicy):
    """S3-FIFO (Yang et al., SOSP'23): a small probation FIFO, a main FIFO with lazy reinsertion, a ghost FIFO.

    New ids enter the small queue (``small_ratio`` of the capacity), or the main queue if the ghost
    queue remembers them. Evicting from small moves an id hit at least ``move_threshold`` times to
    main, else drops it into the ghost queue; evicting from main reinserts an id hit since its last
    pass with its count lowered (at most 3 passes), else drops it. Small is evicted from while main
    is within its share. As libCacheSim: sizes are ``int(capacity * ratio)``, ids moved to main start
    at count 0, and before the first eviction a full small queue sends new ids to main. Unlike
    libCacheSim, a small share of 0 slots (capacity < 10) is allowed: small is then a one-token
    probation buffer (libCacheSim refuses such a cache, and skips insertions while small has 1 slot).
    """

    name = "s3fifo"

    def __init__(self, capacity: int, small_ratio: float = 0.1, ghost_ratio: float = 0.9, move_threshold: int = 2):
        self.capacity = check_capacity(capacity)
        self.small_cap = int(self.capacity * _ratio("small_ratio", small_ratio))
        self.main_cap = self.capacity - self.small_cap
        self.ghost_cap = int(self.capacity * _ratio("ghost_ratio", ghost_ratio))
        if move_threshold < 1:
            raise ValueError(f"move_threshold must be >= 1 hit, got {move_threshold}")
        self.move_threshold = int(move_threshold)
        self.small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.freq: dict[int, int] = {}  # resident id -> hits since insertion (or since its last main pass)
        self.has_evicted = False

    def __contains__(self, e: int) -> bool:
        return e in self.small or e in self.main

    def resident(self) -> list[int]:
        """Resident ids: small (oldest first), then main (oldest first)."""
        return list(self.small) + list(self.main)

    def access(self, e: int) -> None:
        """A hit: count it (the queues do not move)."""
        self.freq[e] += 1

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:
        """Insert ``e`` into small (main after a ghost hit), evicting per S3-FIFO when full."""
        if e in self:
            self.access(e)
            return None
        if self.capacity == 0:
            return e
        full = len(self.small) + len(self.main) >= self.capacity
        if full and all_protected(self.resident(), protect):
            return e
        ghost_hit = e in self.ghost
        if ghost_hit:
            del self.ghost[e]
        victim = self._evict(protect) if full else None
        if ghost_hit or (not self.has_evicted and len(self.small) >= self.small_cap):
            self.main[e] = None
        else:
            self.small[e] = None
        self.freq[e] = 0
        return victim

    def _evict(self, protect: frozenset[int]) -> int:
        self.has_evicted = True
        main_first = len(self.main) > self.main_cap or not self.small
        steps = (self._evict_main, self._evict_small) if main_first else (self._evict_small, self._evict_main)
        for step in steps:
            victim = step(protect)
            if victim is not None:
                return victim
        raise RuntimeError("S3-FIFO found no victim though an unprotected id is resident (bug)")

    def _evict_small(self, protect: frozenset[int]) -> int | None:
        for x in list(self.small):
            if x in protect:
                continue
            del self.small[x]
            if self.freq[x] >= self.move_threshold:
                self.main[x] = None
                self.freq[x] = 0
                continue
            del self.freq[x]
            if self.ghost_cap:
                if len(self.ghost) >= self.ghost_cap:
                    self.ghost.popitem(last=False)
                self.ghost[x] = None
            return x
        return None

    def _evict_main(self, protect: frozenset[int]) -> int | None:
        while any(x not in protect for x in self.main):
            for x in list(self.main):
                if x in protect:
                    continue
                f = self.freq[x]
                if f >= 1:
                    self.main.move_to_end(x)
                    self.freq[x] = min(f, 3) - 1
                else:
                    del self.main[x], self.freq[x]
                    return x
        return None


class SIEVE(ReplacementPolicy):
    """SIEVE (Zhang et al., NSDI'24): one FIFO queue, a visited bit per id, and a hand that sweeps old to new.

    A hit sets the id's bit; new ids enter at the new end with the bit clear. To evict, the hand
    (starting at the oldest id, or where it last stopped) clears set bits while it moves towards the
    new end, wrapping around, and evicts the first id whose bit is clear; it then rests on the next
    newer id. Same as libCacheSim's Sieve, plus the protect rule (the hand passes protected ids by).
    """

    name = "sieve"

    def __init__(self, capacity: int):
        self.capacity = check_capacity(capacity)
        self._newer: dict[int, int | None] = {}  # id -> next newer id (None: the newest)
        self._older: dict[int, int | None] = {}
        self._oldest: int | None = None
        self._newest: int | None = None
        self.visited: dict[int, bool] = {}
        self.hand: int | None = None  # None: the next sweep starts at the oldest id

    def __contains__(self, e: int) -> bool:
        return e in self.visited

    def resident(self) -> list[int]:
        """Resident ids, oldest first."""
        out, x = [], self._oldest
        while x is not None:
            out.append(x)
            x = self._newer[x]
        return out

    def access(self, e: int) -> None:
        """A hit: set the visited bit."""
        self.visited[e] = True

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:
        """Insert ``e`` at the new end, evicting the hand's first unvisited id when full."""
        if e in self:
            self.access(e)
            return None
        if self.capacity == 0:
            return e
        victim = None
        if len(self.visited) >= self.capacity:
            if all_protected(self.visited, protect):
                return e
            victim = self._evict(protect)
        self._older[e], self._newer[e] = self._newest, None
        if self._newest is None:
            self._oldest = e
        else:
            self._newer[self._newest] = e
        self._newest = e
        self.visited[e] = False
        return victim

    def _evict(self, protect: frozenset[int]) -> int:
        x = self._oldest if self.hand is None else self.hand
        while x in protect or self.visited[x]:
            if x not in protect:
                self.visited[x] = False
            x = self._newer[x] if self._newer[x] is not None else self._oldest
        self.hand = self._newer[x]
        older, newer = self._older.pop(x), self._newer.pop(x)
        if older is None:
            self._oldest = newer
        else:
            self._newer[older] = newer
        if newer is None:
            self._newest = older
        else:
            self._older[newer] = older
        del self.visited[x]
        return x


class LIRS(ReplacementPolicy):
    """LIRS (Jiang & Zhang, SIGMETRICS'02): keep the ids with a low inter-reference recency (LIR).

    The stack S orders LIR ids, resident HIR ids and non-resident HIR ids by recency, pruned so that
    its bottom is an LIR id; the queue Q holds the resident HIR ids (``hir_ratio`` of the capacity,
    at least 1), the only ones evicted. A hit on a resident HIR id still in S makes it LIR and demotes
    the bottom LIR id to the end of Q; a miss on an id still in S (non-resident HIR) admits it as LIR
    the same way; other ids enter Q as HIR. Until the cache is full the first ids become LIR. S keeps
    at most ``stack_ratio`` x capacity entries (the oldest non-resident ones go first, as libCacheSim).
    This is the paper's algorithm; libCacheSim's LIRS also demotes an LIR id when a resident HIR id
    absent from S is hit, and then admits new ids as LIR (see benchmarks/results/).
    Protect: if every id of Q is protected, the unprotected LIR id nearest the bottom of S goes.
    """

    name = "lirs"

    def __init__(self, capacity: int, hir_ratio: float = 0.01, stack_ratio: float = 2.0):
        self.capacity = check_capacity(capacity)
        self.hir_cap = max(1, int(self.capacity * _ratio("hir_ratio", hir_ratio))) if self.capacity else 0
        self.lir_cap = self.capacity - self.hir_cap
        if stack_ratio < 1.0:
            raise ValueError(f"stack_ratio must be >= 1 (S holds at least the resident ids), got {stack_ratio}")
        self.stack_cap = int(stack_ratio * self.capacity)
        self.stack: OrderedDict[int, None] = OrderedDict()  # bottom (oldest) first
        self.queue: OrderedDict[int, None] = OrderedDict()  # resident HIR, front (next victim) first
        self.lir: set[int] = set()
        self.nonresident: OrderedDict[int, None] = OrderedDict()  # non-resident HIR in S, by time of eviction

    def __contains__(self, e: int) -> bool:
        return e in self.lir or e in self.queue

    def resident(self) -> list[int]:
        """Resident ids: Q (front first), then the LIR ids from the bottom of S up."""
        return list(self.queue) + [x for x in self.stack if x in self.lir]

    def _push(self, e: int) -> None:
        """Move e to the top of S."""
        self.stack.pop(e, None)
        self.stack[e] = None

    def _prune(self) -> None:
        while self.stack:
            x = next(iter(self.stack))
            if x in self.lir:
                break
            del self.stack[x]
            self.nonresident.pop(x, None)

    def _demote_bottom_lir(self) -> None:
        """The LIR id nearest the bottom of S becomes resident HIR at the end of Q."""
        x = next(x for x in self.stack if x in self.lir)
        del self.stack[x]
        self.lir.discard(x)
        self.queue[x] = None
        self._prune()

    def _to_lir(self, e: int) -> None:
        self.lir.add(e)
        self._push(e)
        if len(self.lir) > self.lir_cap:
            self._demote_bottom_lir()

    def _limit(self) -> None:
        while len(self.stack) > self.stack_cap and self.nonresident:
            x, _ = self.nonresident.popitem(last=False)
            del self.stack[x]

    def access(self, e: int) -> None:
        """A hit on a resident id (LIR, or HIR in Q)."""
        if e in self.lir:
            self._push(e)
            self._prune()
        elif e in self.stack:
            del self.queue[e]
            self._to_lir(e)
        else:
            self._push(e)
            self.queue.move_to_end(e)
        self._limit()

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:
        """A miss: evict the front unprotected id of Q if full, then admit e as LIR or HIR."""
        if e in self:
            self.access(e)
            return None
        if self.capacity == 0:
            return e
        victim = None
        n = len(self.lir) + len(self.queue)
        if n >= self.capacity:
            victim = next((x for x in self.queue if x not in protect), None)
            if victim is not None:
                del self.queue[victim]
                if victim in self.stack:
                    self.nonresident[victim] = None
            else:
                victim = next((x for x in self.stack if x in self.lir and x not in protect), None)
                if victim is None:
                    return e
                del self.stack[victim]
                self.lir.discard(victim)
                self._prune()
        elif len(self.lir) < self.lir_cap:  # filling: the first ids become LIR
            self.nonresident.pop(e, None)
            self.lir.add(e)
            self._push(e)
            self._limit()
            return None
        if e in self.stack:  # a non-resident HIR id with recency: LIR now
            del self.nonresident[e]
            self._to_lir(e)
        else:
            self._push(e)
            self.queue[e] = None
        self._limit()
        return victim


class LeCaR(ReplacementPolicy):
    """LeCaR (Vietri et al., HotStorage'18): regret-minimising choice between LRU and LFU at each eviction.

    On a full miss, LRU's victim is taken with probability ``w_lru``, else LFU's (lowest hit count,
    then least recent); when the two differ, the victim is remembered in that expert's history
    (``capacity // 2`` ids each, FIFO). A miss on an id found in a history is a regret: the weight of
    the other expert is multiplied by ``exp(learning_rate * discount ** age)`` (age in references since
    the eviction; ``discount = 0.005 ** (1 / capacity)`` by default) and the weights renormalised.
    The draws come from SplitMix64 seeded with ``seed`` (so the fast path replays the same draws).
    As libCacheSim: a victim both experts chose goes to no history and takes no draw; a history hit
    starts the id again at count 1.
    """

    name = "lecar"

    def __init__(self, capacity: int, learning_rate: float = 0.45, discount: float | None = None,
                 lru_weight: float = 0.5, seed: int = 0):
        self.capacity = check_capacity(capacity)
        if learning_rate < 0 or not 0.0 <= lru_weight <= 1.0:
            raise ValueError(f"need learning_rate >= 0 and lru_weight in [0, 1], got {learning_rate}, {lru_weight}")
        self.learning_rate = float(learning_rate)
        default = 0.005 ** (1.0 / self.capacity) if self.capacity else 0.0
        self.discount = default if discount is None else float(discount)
        if not 0.0 <= self.discount <= 1.0:
            raise ValueError(f"discount must be in [0, 1], got {self.discount}")
        self.w_lru = float(lru_weight)
        self.hist_cap = self.capacity // 2
        self._rng = int(seed) & MASK64
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._count: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._hist = (OrderedDict(), OrderedDict())  # (LRU's, LFU's) victims -> reference time of the eviction
        self._t = 0

    def __contains__(self, e: int) -> bool:
        return e in self._lru

    def resident(self) -> list[int]:
        """Resident ids, least recently used first."""
        return list(self._lru)

    def histories(self) -> tuple[list[int], list[int]]:
        """The remembered victims of LRU and of LFU, oldest first."""
        return list(self._hist[0]), list(self._hist[1])

    def access(self, e: int) -> None:
        """A hit: most recent, one more count."""
        self._t += 1
        self._lru.move_to_end(e)
        self._count[e] += 1
        self._last[e] = self._t

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:
        """Insert ``e``; when full, evict LRU's or LFU's unprotected candidate by the learned weights."""
        if e in self:
            self.access(e)
            return None
        if self.capacity == 0:
            return e
        full = len(self._lru) >= self.capacity
        if full and all_protected(self._lru, protect):
            return e
        self._t += 1
        for i, hist in enumerate(self._hist):
            if e in hist:  # expert i chose e wrongly: the other one gains weight
                gain = math.exp(self.learning_rate * self.discount ** (self._t - hist.pop(e)))
                w_lru, w_lfu = self.w_lru, 1.0 - self.w_lru
                w_lru, w_lfu = (w_lru, w_lfu * gain) if i == 0 else (w_lru * gain, w_lfu)
                self.w_lru = w_lru / (w_lru + w_lfu)
                break
        victim = self._evict(protect) if full else None
        self._lru[e] = None
        self._count[e], self._last[e] = 1, self._t
        return victim

    def _evict(self, protect: frozenset[int]) -> int:
        by_lru = next(x for x in self._lru if x not in protect)
        by_lfu = min((x for x in self._lru if x not in protect), key=lambda x: (self._count[x], self._last[x]))
        victim, expert = by_lru, -1
        if by_lru != by_lfu:
            self._rng, u = splitmix64(self._rng)
            victim, expert = (by_lru, 0) if u < self.w_lru else (by_lfu, 1)
        del self._lru[victim], self._count[victim], self._last[victim]
        if expert >= 0 and self.hist_cap:
            hist = self._hist[expert]
            if len(hist) >= self.hist_cap:
                hist.popitem(last=False)
            hist[victim] = self._t
        return victim


class LeastStale(ScoredEviction):
    """Evict the resident expert most overdue relative to its own learned reuse interval."""

    name = "least_stale"

    def __init__(self, capacity: int, alpha: float = 0.25, keep_history: bool = False):
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 expert slots, got {capacity}")
        self.capacity = int(capacity)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        self.keep_history = keep_history
        self._last: dict[int, int] = {}  # reference time of the last use
        self._interval: dict[int, float] = {}  # learned reuse interval (0: never reused)
        self._res: set[int] = set()
        self._t = 0

    def staleness(self, e: int, now: int | None = None) -> float:
        """Time since e's last use over its reuse interval (at least 1), at reference time `now` (the next one)."""
        now = self._t + 1 if now is None else now
        return float(now - self._last[e]) / max(self._interval[e], 1.0)

    def _rank(self, e: int) -> tuple[float, int]:
        """The stalest first; ties: the least recently used."""
        return (-self.staleness(e), self._last[e])

    def _ref(self, e: int) -> None:
        self._t += 1
        last = self._last.get(e)
        if last is None:
            self._interval[e] = 0.0
        else:
            gap, old = float(self._t - last), self._interval[e]
            self._interval[e] = gap if old == 0.0 else (1.0 - self.alpha) * old + self.alpha * gap
        self._last[e] = self._t

    def access(self, e: int) -> None:
        """A use: learn the interval since the last one."""
        self._ref(e)

    def _forget(self, e: int) -> None:
        if not self.keep_history:
            del self._last[e], self._interval[e]


class CLOCK(ReplacementPolicy):
    """CLOCK in the textbook form: a ring of slots (a Python list), a hand, a reference bit per resident."""

    name = "clock"

    def __init__(self, capacity: int):
        self.capacity = check_capacity(capacity)
        self.ring: list[int] = []
        self.bit: dict[int, bool] = {}
        self.hand = 0

    def __contains__(self, e: int) -> bool:
        return e in self.bit

    def resident(self) -> list[int]:
        """Resident ids from the hand round the ring."""
        return self.ring[self.hand:] + self.ring[:self.hand]

    def access(self, e: int) -> None:
        """A use sets the bit."""
        self.bit[e] = True

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:
        """A free slot, else the first unprotected resident past the hand whose bit is clear."""
        if e in self.bit:
            self.access(e)
            return None
        if len(self.ring) < self.capacity:
            self.ring.append(e)
            self.bit[e] = False
            return None
        if all(x in protect for x in self.ring):
            return e
        while True:
            x = self.ring[self.hand]
            if x not in protect:
                if not self.bit[x]:
                    del self.bit[x]
                    self.ring[self.hand] = e
                    self.bit[e] = False
                    self.hand = (self.hand + 1) % self.capacity
                    return x
                self.bit[x] = False
            self.hand = (self.hand + 1) % self.capacity


REFERENCE = {c.name: c for c in (LRU, LFU, ARC, Belady, LRFU, RouterEMA, S3FIFO, SIEVE, LIRS, LeCaR, LeastStale, CLOCK)}
