"""LeCaR (Vietri et al., HotStorage 2018): LRU and LFU mixed by regret, over expert ids.

What this file is: one `ReplacementPolicy` (contract in `replacement.py`), split from
`replacement_field.py` (S3-FIFO, SIEVE, LIRS), whose protect rule and SplitMix64 stream it shares so
that the compiled replay (`sim/fast/field.py`) draws the same random numbers. The registry names it "lecar".
"""
from __future__ import annotations

import math
from collections import OrderedDict

from fate_lab.policy.replacement import ReplacementPolicy, check_capacity
from fate_lab.policy.replacement_field import MASK64, all_protected, splitmix64


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
        self.discount = (0.005 ** (1.0 / self.capacity) if self.capacity else 0.0) if discount is None else float(discount)
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
