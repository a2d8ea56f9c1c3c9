"""The runtime's driver of the expert cache: a real transfer engine behind the cache's `Mover` protocol.

What this file is: `EngineMover` (submit / cancel / poll / wait / reload / capacity over a
`transfer.TransferEngine`), which reports landed bytes, stall time and timeline events to its driver's
`core.recorder.Recorder`, asks the driver core's precision rule what a transfer travels at, and sizes prefetches by
the link (`link_capacity`).
What it is not: the cache (`policy/cache.py`), the engines (`transfer.py`) or the runtime.
"""
from __future__ import annotations

import time

from fate_lab.core.driver import Precision, link_capacity, link_view
from fate_lab.core.recorder import Recorder
from fate_lab.offloading.transfer import Transfer, TransferEngine


class EngineMover:
    """The cache's link over a real transfer engine; what it counts goes to `rec`."""

    def __init__(self, spec: Precision, rec: Recorder, engine: TransferEngine):
        self.spec, self.rec, self.engine = spec, rec, engine
        self.observers: list = []  # callables fed every Transfer queued (`Runtime.watch_transfers`)

    def submit(self, m: int, e: int, slot: int, urgent: bool, reason: str) -> Transfer:
        """Queue (m, e) on the engine at the precision of reason."""
        t = self.engine.submit(m, e, slot, urgent=urgent, spec=self.spec(m, reason))
        t.reason = reason
        for fn in self.observers:
            fn(t)
        return t

    def cancel(self, t: Transfer) -> bool:
        """Drop t if not started."""
        return self.engine.cancel(t)

    def _record(self, t: Transfer) -> None:
        if t.counted:
            return
        t.counted = True
        if t.ok:
            self.rec.landed(t.m, t.nbytes, t.spec)
        if t.t_start is not None and t.t_end is not None:
            self.rec.event("demand" if t.urgent else "prefetch", t.m, t.e, t.t_start, t.t_end)

    def poll(self, t: Transfer) -> bool | None:
        """None while in flight, else whether it landed."""
        if not self.engine.poll(t):
            return None
        self._record(t)
        return t.ok

    def wait(self, m: int, e: int, t: Transfer) -> bool:
        """Block until t is done; the wait is layer m's stall."""
        w0 = time.perf_counter()
        ok = self.engine.wait(t)
        self._record(t)
        self.rec.stall(m, e, w0, time.perf_counter())
        return ok

    def reload(self, m: int, e: int, slot: int, reason: str) -> None:
        """Synchronous reload after a failed transfer (counted as moved bytes and as stall)."""
        spec = self.spec(m, reason)
        w0 = time.perf_counter()
        self.engine.load_now(m, e, slot, spec)
        self.rec.landed(m, self.engine.nbytes(m, e, spec), spec)
        self.rec.event("sync_load", m, e, w0, time.perf_counter())
        self.rec.stall(m, e, w0, time.perf_counter())

    def capacity(self, m: int) -> int | None:
        """Prefetches the link can start before layer m's call, from the measured layer time."""
        if self.engine.link is None:
            return None
        spec = self.spec(m, "prefetch")
        return link_capacity(self.rec.prefetch_window_s(), self.engine.backlog_s(),
                             self.engine.link.transfer_time(self.engine.nbytes(m, 0, spec)))

    def view(self, m: int):
        """The value planner's view of the link for layer m (`core.driver.link_view`); None on the instant link."""
        if self.engine.link is None:
            return None
        return link_view(self.rec, self.spec, m, self.engine.backlog_s(),
                         lambda spec: self.engine.link.transfer_time(self.engine.nbytes(m, 0, spec)))
