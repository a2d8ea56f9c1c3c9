"""The per-layer state of the one expert cache, and the `Mover` protocol the cache drives.

What this file is: `Mover` (what the cache asks of its driver: submit, cancel, poll, wait, reload,
capacity, view), `LayerState` (which expert of one MoE layer sits in which slot, what is in flight, staged,
pending, deferred, on the host, stood in for) and the two small records the cache keeps (`_Inflight`,
`_Pool`), plus `HOST`, the "slot" of an expert computed on the host.
What it is not: the state machine that changes them (`cache.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from fate_lab.policy.replacement import ReplacementPolicy

HOST = -1  # the "slot" of an expert that computes on the host


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


@dataclass(eq=False)
class _Inflight:
    handle: Any
    slot: int
    urgent: bool
    reason: str


@dataclass(eq=False)
class _Pool:
    """A pool of staging slots."""

    name: str
    free: list[int]


@dataclass(eq=False)
class LayerState:
    """Slot bookkeeping of one MoE layer."""

    cache_slots: list[int]  # slot ids this layer's cache owns
    policy: ReplacementPolicy  # over expert ids, capacity len(cache_slots)
    where: dict[int, int] = field(default_factory=dict)  # cached (reserved) expert -> slot
    valid: set[int] = field(default_factory=set)  # cached experts whose slot holds their bytes
    staged: dict[int, int] = field(default_factory=dict)  # expert -> staging slot (not cached)
    inflight: dict[int, _Inflight] = field(default_factory=dict)  # expert -> transfer in flight
    prefetched: set[int] = field(default_factory=set)  # moved by the predictor for the next call
    prediction: list[int] | None = None  # predicted set for the next call
    pending: set[int] = field(default_factory=set)  # needed by the current call, not computed yet
    deferred: list[int] = field(default_factory=list)  # misses still waiting for a slot
    host: set[int] = field(default_factory=set)  # needed by the current call, computed on the host
    subst: dict[int, int] = field(default_factory=dict)  # missed expert -> resident stand-in (this call)
    lowp: set[int] = field(default_factory=set)  # misses computed from their resident low-precision copy

    @property
    def free(self) -> list[int]:
        """Cache slots reserved by nobody."""
        used = set(self.where.values())
        return [s for s in self.cache_slots if s not in used]

    def resident(self) -> set[int]:
        """Experts usable now without a transfer: valid cached or staged with nothing in flight."""
        return (self.valid | set(self.staged)) - set(self.inflight)
