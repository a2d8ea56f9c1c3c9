"""The runtime's driver of the expert cache: a real transfer engine behind the cache's `Link` protocol.

What this file is: `EngineLink` (submit / cancel / poll / wait / reload / capacity over a
`transfer.TransferEngine`, counting bytes, stall time and timeline events into the runtime's
stats, and sizing prefetches by the link: `link_capacity`) and `spec_label`.
What it is not: the cache (`policy/cache.py`) or the engines (`transfer.py`).
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from fate_lab.offloading.transfer import Transfer, TransferEngine
from fate_lab.quant import QuantSpec

if TYPE_CHECKING:  # the runtime imports this module
    from fate_lab.offloading.runtime import Runtime


STALL_MIN_S = 2e-5  # a wait shorter than this is bookkeeping, not a stall
WINDOW_EMA = 0.3  # weight of the newest step in the per-phase layer-time estimate (prefetch window)


def spec_label(spec: QuantSpec | None) -> str:
    """A short name of a transfer precision for counters: 'fp', 'int4/g64', ..."""
    return "fp" if spec is None else f"int{spec.bits}/g{spec.group_size}" + ("/hqq" if spec.refine else "")


def link_capacity(window_s: float | None, backlog_s: float, transfer_s: float) -> int | None:
    """Prefetches a link can *start* within window_s when backlog_s of work is already queued.

    None (no limit) without a window estimate or with a zero-time link. A transfer that starts
    inside the window but lands after it still saves part of the wait, so this counts starts:
    ceil((window - backlog) / transfer), at least 0.
    """
    if window_s is None or transfer_s <= 0:
        return None
    return max(0, math.ceil((window_s - backlog_s) / transfer_s - 1e-9))


class EngineLink:
    """The cache's driver over a real transfer engine: counts bytes, stall and the timeline."""

    def __init__(self, rt: "Runtime", engine: TransferEngine):
        self.rt, self.engine = rt, engine

    def submit(self, m: int, e: int, slot: int, urgent: bool, reason: str) -> Transfer:
        """Queue (m, e) on the engine at the precision of reason."""
        t = self.engine.submit(m, e, slot, urgent=urgent, spec=self.rt.spec(m, reason))
        t.reason = reason
        return t

    def cancel(self, t: Transfer) -> bool:
        """Drop t if not started."""
        return self.engine.cancel(t)

    def _record(self, t: Transfer) -> None:
        if t.counted:
            return
        t.counted = True
        rt = self.rt
        if t.ok:
            rt.stats.layers[t.m][rt.phase].bytes_moved += t.nbytes
            rt.stats.moved[rt.phase, t.m, spec_label(t.spec)] += 1
        if t.t_start is not None and t.t_end is not None:
            rt.event("demand" if t.urgent else "prefetch", t.m, t.e, t.t_start, t.t_end)

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
        self.rt.stall(m, e, w0, time.perf_counter())
        return ok

    def reload(self, m: int, e: int, slot: int, reason: str) -> None:
        """Synchronous reload after a failed transfer (counted as moved bytes and as stall)."""
        rt, spec = self.rt, self.rt.spec(m, reason)
        w0 = time.perf_counter()
        self.engine.load_now(m, e, slot, spec)
        rt.stats.layers[m][rt.phase].bytes_moved += self.engine.nbytes(m, e, spec)
        rt.stats.moved[rt.phase, m, spec_label(spec)] += 1
        rt.event("sync_load", m, e, w0, time.perf_counter())
        rt.stall(m, e, w0, time.perf_counter())

    def capacity(self, m: int) -> int | None:
        """Prefetches the link can start before layer m's call, from the measured layer time."""
        if self.engine.link is None:
            return None
        spec = self.rt.spec(m, "prefetch")
        w = self.rt.window_s.get(self.rt.phase)
        return link_capacity(None if w is None else w * self.rt.config.prefetch_window, self.engine.backlog_s(),
                             self.engine.link.transfer_time(self.engine.nbytes(m, 0, spec)))
