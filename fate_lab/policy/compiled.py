"""A compiled policy as the runtime and the simulator call it: one `ReplacementPolicy` over a `kernels` record.

What this file is: `CompiledPolicy`, which keeps one layer's policy state (`kernels.record.State`) and calls the
policy's compiled functions from Python, one call per admit or use (about 0.3 us each), and `next_uses`, the
future a policy that reads it gets. The fast replay runs the very same functions inlined into its compiled loop.
What it is not: a policy (those are the files of `kernels/`), or the registry by name (`registry.py`).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
from numba import njit

from fate_lab.policy.kernels.record import Policy, State
from fate_lab.policy.replacement import ReplacementPolicy, check_capacity

DEFAULT_IDS = 1024  # the id bound of a policy built without num_experts


@njit(cache=True)
def next_uses(uses):
    """next[t, j]: the next token after t that uses uses[t, j] (N if none), for uses [N, k]."""
    N, k = uses.shape
    out = np.empty((N, k), np.int32)
    E = uses.max() + 1 if uses.size else 1
    seen = np.full(E, N, np.int32)
    for t in range(N - 1, -1, -1):
        for j in range(k):
            out[t, j] = seen[uses[t, j]]
        for j in range(k):
            seen[uses[t, j]] = t
    return out


@njit(cache=True)
def next_uses_layers(uses):
    """next[l, t, j]: the next token after t whose layer l uses uses[t, l, j] (N if none; uses [N, L, k]): the
    `next_uses` of each layer (the fast replay's future)."""
    N, L, k = uses.shape
    out = np.empty((L, N, k), np.int32)
    for l in range(L):
        out[l] = next_uses(uses[:, l])
    return out


@njit(cache=True, _nrt=False)
def _mark(prot, idx, v):
    """prot[x] = v for each id x of idx inside prot's first len(prot) - 8 ids (the policy's id bound)."""
    E = prot.shape[0] - 8
    for x in idx:
        if 0 <= x < E:
            prot[x] = v


def future_array(future: Sequence[Iterable[int]]) -> np.ndarray:
    """future[t] (the ids token t uses) as an int64 array [N, k]; a short row is padded with its own first id."""
    rows = [[int(e) for e in es] for es in future]
    k = max((len(r) for r in rows), default=1) or 1
    out = np.zeros((len(rows), k), np.int64)
    for t, r in enumerate(rows):
        if r:
            out[t] = r + [r[0]] * (k - len(r))
        elif t:
            out[t] = out[t - 1]  # a token without uses: repeat the last row's (its next uses are unchanged)
    return out


class CompiledPolicy(ReplacementPolicy):
    """One layer's cache policy: the record's compiled functions over its own state arrays."""

    def __init__(self, record: Policy, capacity: int, num_experts: int | None = None,
                 future: Sequence[Iterable[int]] | None = None, **kw):
        self.record = record
        self.name = record.name
        self.wants_scores = record.needs_scores
        self.capacity = check_capacity(capacity)
        E = DEFAULT_IDS if num_experts is None else int(num_experts)
        if E < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.E = E
        self._prm, self._iprm = record.params(self.capacity, kw)
        self._st = State(E)
        self._uses = np.zeros((0, 1), np.int64)
        self._next = np.zeros((0, 1), np.int32)
        if future is not None:
            self._uses = future_array(future)
            if self._uses.size and (self._uses.min() < 0 or self._uses.max() >= E):
                raise ValueError(f"future holds ids outside 0..{E - 1}")
            self._next = next_uses(self._uses)
        self._prot = np.zeros(E + 8, np.uint8)
        self._res: set[int] = set()
        st = self._st
        record.init(st.I, st.F, st.S, st.G, st.R, E, self.capacity, self._prm, self._iprm, self._uses)

    def _id(self, e) -> int:
        e = int(e)
        if not 0 <= e < self.E:
            raise ValueError(f"expert id {e} is outside 0..{self.E - 1} of policy {self.name!r} "
                             "(build it with num_experts=)")
        return e

    def __contains__(self, e) -> bool:
        return e in self._res

    def __len__(self) -> int:
        return len(self._res)

    def resident(self) -> list[int]:
        """Resident ids, in id order (`victim` says which one an admit would evict)."""
        return sorted(self._res)

    def observe(self, probs: Sequence[float], n_tokens: int = 1) -> None:
        """The router's probabilities of the layer's experts, averaged over a call's n tokens."""
        st = self._st
        self.record.observe(st.I, st.F, st.S, st.G, st.R, self.E, np.asarray(probs, np.float64), int(n_tokens))

    def at(self, t: int) -> None:
        """Token t starts (a policy that reads the future moves its clock; others ignore it)."""
        if self.record.reads_future:
            st = self._st
            self.record.tick(st.I, st.F, st.S, st.G, st.R, self.E, int(t), self._uses, self._next)

    def access(self, e: int) -> None:
        """A further use of the resident e."""
        st = self._st
        self.record.access(st.I, st.F, st.S, st.G, st.R, self.E, e)

    def _admit(self, st: State, e: int, protect) -> int:
        prot = self._prot
        if not protect or len(self._res) < self.capacity:  # (`victim` never gets here with room)
            # with room no registered policy evicts, so the protect set cannot matter (tests/policy/
            # test_compiled_policies.py checks every policy): skip marking it, ~1-4 us per admit of a cold cache
            return self.record.admit(st.I, st.F, st.S, st.G, st.R, self.E, e, prot)
        idx = np.fromiter(protect, np.int64, len(protect))
        _mark(prot, idx, 1)
        try:
            return self.record.admit(st.I, st.F, st.S, st.G, st.R, self.E, e, prot)
        finally:
            _mark(prot, idx, 0)

    def admit(self, e: int, protect: frozenset[int] = frozenset()) -> int | None:
        """Insert non-resident e: the evicted id, None, or e itself if nothing may be evicted (not cached)."""
        if e in self._res:
            self.access(e)
            return None
        e = self._id(e)
        v = self._admit(self._st, e, protect)
        if v == e:
            return e
        self._res.add(e)
        if v >= 0:
            self._res.discard(v)
            return v
        return None

    def admit_row(self, e: int, prot: np.ndarray) -> int:
        """`admit` with the protect set as a uint8 row over ids (the cache's state machine keeps one; its length
        at least E + 8): -1 (nothing evicted), the evicted id, or e (not cached)."""
        e = self._id(e)
        st = self._st
        v = self.record.admit(st.I, st.F, st.S, st.G, st.R, self.E, e, prot)
        if v != e:
            self._res.add(e)
            if v >= 0:
                self._res.discard(v)
        return v

    def victim(self, e: int, protect=frozenset()) -> int | None:
        """The resident an admit of the non-resident e would evict now, protecting `protect` (None: none), found
        by admitting e into a copy of the state: the policy's own rule, not an order guessed from outside."""
        if e in self._res or len(self._res) < self.capacity:
            return None
        e = self._id(e)
        v = self._admit(self._st.copy(), e, frozenset(protect) | {e})
        return None if v < 0 or v == e else v
