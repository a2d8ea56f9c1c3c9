"""Replacement policies from the caching field: S3-FIFO, SIEVE and LIRS, over expert ids.

What this file is: three `ReplacementPolicy` classes (the contract is in `replacement.py`'s module
docstring), so the runtime, the timed simulator and the replay all have them. Importing
`registry.py` lists them by name as "s3fifo", "sieve" and "lirs"
(LeCaR, "lecar", is in `replacement_lecar.py`; SpecMD's "least_stale" in `replacement_moe.py`). Each follows its paper, and where the
paper leaves a choice open, libCacheSim's implementation by the authors (S3-FIFO, SIEVE) or by the
libCacheSim team (LIRS, LeCaR); the class docstrings say where this file differs.

The protect rule, the one thing the papers do not have: a protected id (an expert the current token
still needs) is invisible to the eviction procedure -- the queue scans and the hand pass over it
without changing its state -- and if every resident is protected, ``admit`` returns ``e`` and
changes nothing. With one expert per token nothing is ever protected, and the policies are the
papers' (benchmarks/bench_policies.py checks that against libCacheSim).

What it is not: a cache. It never decides when to load, only what to drop; the slot bookkeeping is
`cache.ExpertCache`, and the compiled replay of the same policies is `sim/fast/field.py`.
"""
from __future__ import annotations

from collections import OrderedDict

from fate_lab.policy.replacement import ReplacementPolicy, check_capacity

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
