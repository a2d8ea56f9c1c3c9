"""The per-layer state of the one expert cache, and the `Mover` protocol the cache drives.

What this file is: `Mover` (what the cache asks of its driver: submit, cancel, poll, wait, reload,
capacity, view) and `LayerState`: one MoE layer's policy and state (`cache_core.Lay`: which expert sits in which
slot, what is in flight, staged, pending, deferred, on the host, stood in for), with read-only views of that state
as sets and dicts (for tests, notebooks and the value cache's planning). `Pool` is a view of a staging pool.
What it is not: the state machine that changes them (`cache_core.py`, driven by `cache.py`).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import numpy as np

from fate_lab.policy.cache_core import HASPRED, NSLOTS, NUSED, Lay
from fate_lab.policy.replacement import ReplacementPolicy


class Mover(Protocol):
    """What the cache asks of its driver to move experts over the link (the runtime's `EngineMover` over a transfer
    engine, the simulator's `SimMover`, the replay's instant mover). "link" alone names the physical link (a
    `hardware.links.LinkProfile`); a transfer engine (`offloading/transfer.py`) is what moves bytes over it."""

    def submit(self, m: int, e: int, slot: int, urgent: bool, reason: str) -> Any:
        """Queue expert (m, e) into slot; urgent loads go before queued prefetches. Returns a handle."""

    def cancel(self, handle: Any) -> bool:
        """Drop a transfer the link has not started; True if dropped (nothing moved)."""

    def poll(self, handle: Any) -> bool | None:
        """None while in flight; True once its bytes landed; False if it failed."""

    def wait(self, m: int, e: int, handle: Any) -> bool:
        """Block until done (the stall is the driver's to count); True if the bytes landed."""

    def reload(self, m: int, e: int, slot: int, reason: str) -> None:
        """Load (m, e) into slot synchronously (after a failed transfer)."""

    def capacity(self, m: int) -> int | None:
        """Prefetches the link can start before layer m needs them; None: no limit."""

    def view(self, m: int) -> Any:
        """The link's timing for layer m's transfers as a `value.LinkView` (None: an instant link, or no layer
        time measured yet); only the value cache (`value_cache.py`) asks."""


def items(a) -> list:
    """The items of a list of the cache's state (element 0 holds its length)."""
    return list(a[1:a[0] + 1])


class Pool(NamedTuple):
    """A view of a staging pool: its name and its free slots (the next one taken last)."""

    name: str
    free: list[int]


class LayerState:
    """One MoE layer of the cache: its replacement policy and its state `L` (a `cache_core.Lay` of Python lists,
    which `cache_core`'s functions change); the properties are read-only copies."""

    __slots__ = ("policy", "L")

    def __init__(self, cache_slots: list[int], policy: ReplacementPolicy, num_ids: int, parity: int):
        E = num_ids
        self.policy = policy
        self.L = Lay(where=[-1] * E, staged=[-1] * E, valid=[0] * E, infl=[0] * E, urg=[0] * E, reason=[0] * E,
                     pref=[0] * E, pend=[0] * E, host=[0] * E, lowp=[0] * E, subst=[-1] * E, mark=[0] * E,
                     handle=[None] * E, prot=np.zeros(E + 8, np.uint8), inflist=[0] * (E + 1), stlist=[0] * (E + 1),
                     preflist=[0] * (E + 1), deferred=[0] * (E + 1), pred=[0], touched=[0] * (E + 1),
                     cslots=list(cache_slots), sc=[0, 0, len(cache_slots), parity, 0])

    @property
    def cache_slots(self) -> list[int]:
        """Slot ids this layer's cache owns."""
        return list(self.L.cslots)

    @property
    def where(self) -> dict[int, int]:
        """Cached (reserved) expert -> slot."""
        return {e: s for e, s in enumerate(self.L.where) if s >= 0}

    @property
    def valid(self) -> set[int]:
        """Cached experts whose slot holds their bytes."""
        return {e for e, v in enumerate(self.L.valid) if v}

    @property
    def staged(self) -> dict[int, int]:
        """Expert -> staging slot (not cached), in the order they were staged."""
        return {e: self.L.staged[e] for e in items(self.L.stlist)}

    @property
    def inflight(self) -> dict[int, int]:
        """Expert -> the slot its transfer in flight fills, in the order they were queued."""
        L = self.L
        return {e: L.staged[e] if L.staged[e] >= 0 else L.where[e] for e in items(L.inflist)}

    @property
    def pending(self) -> set[int]:
        """Needed by the current call, not computed yet."""
        return {e for e in items(self.L.touched) if self.L.pend[e]}

    @property
    def prefetched(self) -> set[int]:
        """Moved by the predictor for the next call."""
        return set(items(self.L.preflist))

    @property
    def deferred(self) -> list[int]:
        """Misses still waiting for a slot."""
        return items(self.L.deferred)

    @property
    def host(self) -> set[int]:
        """Needed by the current call, computed on the host."""
        return {e for e in items(self.L.touched) if self.L.host[e]}

    @property
    def prediction(self) -> list[int] | None:
        """The predicted set for the next call (None: none)."""
        return items(self.L.pred) if self.L.sc[HASPRED] else None

    @prediction.setter
    def prediction(self, ids) -> None:
        ids = [] if ids is None else list(ids)
        self.L.pred[:] = [len(ids), *ids]
        self.L.sc[HASPRED] = 0 if ids is None else 1

    @property
    def free(self) -> list[int]:
        """Cache slots reserved by nobody."""
        return list(self.L.cslots[self.L.sc[NUSED]:])

    @property
    def full(self) -> bool:
        """Every cache slot is reserved."""
        return self.L.sc[NUSED] >= self.L.sc[NSLOTS]

    def resident(self) -> set[int]:
        """Experts usable now without a transfer: valid cached or staged with nothing in flight."""
        L = self.L
        return {e for e in range(len(L.where)) if (L.valid[e] or L.staged[e] >= 0) and not L.infl[e]}
