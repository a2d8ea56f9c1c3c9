"""The interface of a per-layer expert-cache replacement policy: pure bookkeeping over expert ids.

A policy answers one question, "which resident expert goes?". It holds no weights, touches no device and no thread;
the runtime's slot manager, the simulator and the trace replay drive the same objects. One policy instance manages
the cache of ONE MoE layer.

Contract shared by every policy (the replay and the runtime rely on it):

- ``admit(e)`` inserts a non-resident expert and counts as its first reference (an on-demand load or a prefetch);
  ``access(e)`` is a further use of a resident expert.
- ``admit`` never evicts an id in ``protect`` (the experts the current token still needs). If nothing can be evicted
  (capacity 0, or every resident id is protected) it returns ``e`` itself, meaning "not cached": the caller uses
  the expert from a transient buffer.
- ``admit`` of an already-resident id is treated as ``access`` and returns None.
- A policy with ``wants_scores = True`` also gets ``observe(probs, n_tokens)`` once per experts call, BEFORE its
  accesses: the router's probability of every expert of its layer, averaged over the call's n tokens.

The project's policies are compiled, one file each in `policy/kernels/`, and reach the drivers as
`compiled.CompiledPolicy`; `registry.py` builds them by name. A subclass of `ReplacementPolicy` written in plain
Python also runs (a factory ``capacity -> policy`` given to `replay`), on the replay's uncompiled path.
This module is not the slot manager: it never decides *when* to load, only *what* to drop.
"""
from __future__ import annotations

from typing import Sequence


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

    def admit_row(self, e: int, prot) -> int:
        """`admit` as the cache's state machine (`cache_core.py`) calls it: ``prot`` a uint8 row over ids (non-zero:
        protected, 8 spare ids at its end), the answer an int (-1: nothing evicted)."""
        v = self.admit(e, frozenset(int(x) for x in prot[:len(prot) - 8].nonzero()[0]))
        return -1 if v is None else v

    def victim(self, e: int, protect=frozenset()) -> int | None:
        """The resident an admit of ``e`` would evict, protecting ``protect`` (None: none would go). Here: the first
        unprotected id of `resident()`'s eviction order; a policy that knows better overrides it."""
        if len(self) < self.capacity:
            return None
        return next((x for x in self.resident() if x not in protect and x != e), None)


def check_capacity(capacity: int) -> int:
    """The capacity as an int, refusing a negative one."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0 expert slots, got {capacity}")
    return int(capacity)
