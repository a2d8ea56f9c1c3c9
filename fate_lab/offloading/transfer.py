"""Transfer engines: move one expert from the host store into a device slot, asynchronously.

What this file is: one interface (`submit`, `cancel`, `poll`, `wait`, `backlog_s`, `close`) and
three back ends, plus the synchronous load and the link calibration:
- `EmulatedEngine`: a worker thread takes transfers from a queue (urgent ones first), does the
  real copy into the slot, then holds the link until `latency + bytes / bandwidth` has passed
  since it started. It runs concurrently with the compute thread, so overlap and stalls are
  real wall-clock effects. Used on CPU-only machines, and on a GPU to emulate a slower link.
- `CudaCopyEngine`: a dedicated CUDA copy stream; each transfer is a pair of non-blocking
  copies from pinned host memory, ordered after the compute stream's earlier work (a slot may
  still be read by a kernel) and marked done by a CUDA event.
- `InstantEngine`: the copy happens inside `submit` and the transfer is done when it returns (the
  link `"instant"`): no timing at all, so the runtime's counts can be compared exactly with the
  replay's and the simulator's.
All accept a fault hook `fault(m, e) -> bool` (tests): True makes that transfer fail.
Quantized transfers (`submit(..., spec=QuantSpec)`) move the store's packed copy; `Transfer.nbytes`
is its packed size, so the emulated link holds for the packed bytes. How the bytes sit in the
slot (dequantized into a full-precision slot, or kept packed) is `slots.py`'s business.

What it is not: it decides nothing. Which expert goes to which slot, when, and what to do
when a transfer fails is the cache's (`cache.py`) and the runtime's business.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from fate_lab.hardware.links import LinkProfile
from fate_lab.offloading.slots import DeviceSlots, SlotWriter
from fate_lab.offloading.store import HostStore
from fate_lab.quant import QuantSpec

_ENGINE_IDS = itertools.count()
DEFAULT_TIMEOUT_S = 60.0  # the longest a compute thread waits for one expert before it gives up


class TransferError(RuntimeError):
    """A transfer can never arrive: the engine's worker died, or the wait ran past its timeout."""


@dataclass(eq=False)
class Transfer:
    """One expert on its way into one slot; `done` is set when it finished, failed or was cancelled."""

    m: int
    e: int
    slot: int
    nbytes: int
    urgent: bool
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    cancelled: bool = False
    error: str | None = None
    t_start: float | None = None  # perf_counter when the link started on it
    t_end: float | None = None
    cuda_event: object = None
    spec: QuantSpec | None = None  # precision it travels at; None: full precision (the slots' dtype)
    reason: str = ""  # why it moves: "miss", "prefetch", "prefill_low", "cache" (counters, timeline)
    counted: bool = False  # its bytes were added to the counters (the driver counts each transfer once)


class TransferEngine:
    """Interface of the back ends."""

    fault: Callable[[int, int], bool] | None = None
    link: LinkProfile | None = None  # the profile it emulates; None: the real link (unknown speed)

    def submit(self, m: int, e: int, slot: int, urgent: bool = False,
               spec: QuantSpec | None = None) -> Transfer:  # pragma: no cover
        """Queue expert (m, e) for copy into `slot` at spec; urgent transfers go before queued prefetches."""
        raise NotImplementedError

    def cancel(self, t: Transfer) -> bool:  # pragma: no cover
        """Drop t if the link has not started it; True if dropped."""
        raise NotImplementedError

    def wait(self, t: Transfer) -> bool:  # pragma: no cover
        """Block until t is done; True if its bytes are in the slot."""
        raise NotImplementedError

    def poll(self, t: Transfer) -> bool:
        """True if t is done (finished, failed or cancelled), without blocking."""
        return t.done.is_set()

    def backlog_s(self) -> float:
        """Seconds of link time already committed (queued + the rest of the running transfer); 0 if unknown."""
        return 0.0

    def close(self) -> None:  # pragma: no cover
        """Stop the engine; queued transfers are cancelled."""
        raise NotImplementedError

    def release(self) -> None:
        """Once closed, let go of the slots and the store it writes (a closed runtime that is still referenced must
        not keep its slots' memory alive through its engine); a transfer after this fails on its own thread."""
        self._writer = None

    @property
    def threads(self) -> list[threading.Thread]:
        """Worker threads this engine started."""
        return []

    def load_now(self, m: int, e: int, slot: int, spec: QuantSpec | None, timed: bool = True) -> float:
        """Synchronous load of (m, e) at spec into slot on the calling thread, holding for the link's
        time if timed and the link is emulated; returns the seconds it took."""
        t0 = time.perf_counter()
        self._writer.write(m, e, slot, spec, non_blocking=False)  # (2I, H) + (H, I), packed if spec
        if timed and self.link is not None:
            hold = t0 + self.link.transfer_time(self._writer.nbytes(m, e, spec)) - time.perf_counter()
            if hold > 0:
                time.sleep(hold)
        return time.perf_counter() - t0

    def nbytes(self, m: int, e: int, spec: QuantSpec | None) -> int:
        """Bytes a transfer of (m, e) at spec moves."""
        return self._writer.nbytes(m, e, spec)


class InstantEngine(TransferEngine):
    """The link "instant": `submit` copies at once on the calling thread and returns a finished transfer."""

    def __init__(self, store: HostStore, slots: DeviceSlots, fault: Callable[[int, int], bool] | None = None):
        self.fault = fault
        self._writer = SlotWriter(store, slots)
        self._closed = False

    def submit(self, m: int, e: int, slot: int, urgent: bool = False, spec: QuantSpec | None = None) -> Transfer:
        """Copy now; the returned transfer is done."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        t = Transfer(m, e, slot, self._writer.nbytes(m, e, spec), urgent, spec=spec)
        t.t_start = time.perf_counter()
        try:
            if self.fault is not None and self.fault(m, e):
                raise IOError(f"injected fault on expert {e} of MoE layer {m}")
            self._writer.write(m, e, slot, spec, non_blocking=False)
            t.ok = True
        except Exception as exc:  # reported on the transfer, as the other engines do
            t.error = repr(exc)
        t.t_end = time.perf_counter()
        t.done.set()
        return t

    def cancel(self, t: Transfer) -> bool:
        """Nothing is ever queued."""
        return False

    def wait(self, t: Transfer) -> bool:
        """Already done."""
        return t.ok

    def close(self) -> None:
        """Refuse further transfers."""
        self._closed = True


class EmulatedEngine(TransferEngine):
    """A worker thread that does the real copy and keeps the link busy for the profile's time."""

    def __init__(self, store: HostStore, slots: DeviceSlots, link: LinkProfile,
                 fault: Callable[[int, int], bool] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.link = link
        self.fault = fault
        self.timeout_s = timeout_s
        self.dead: str | None = None  # why the worker stopped, if it died
        self._writer = SlotWriter(store, slots)
        self._cuda = slots.device.type == "cuda"
        self._stream = torch.cuda.Stream(slots.device) if self._cuda else None
        self._running: Transfer | None = None
        self._queue: collections.deque[Transfer] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"fate-transfer-{next(_ENGINE_IDS)}", daemon=True)
        self._thread.start()

    def submit(self, m: int, e: int, slot: int, urgent: bool = False, spec: QuantSpec | None = None) -> Transfer:
        """Queue a transfer; urgent ones (on-demand loads) jump ahead of queued prefetches."""
        if self.dead is not None:
            raise TransferError(f"the transfer worker died ({self.dead}); cannot move expert {e} of MoE layer {m}")
        t = Transfer(m, e, slot, self._writer.nbytes(m, e, spec), urgent, spec=spec)
        if self._cuda:  # the slot may still be read by queued kernels of the compute stream
            t.cuda_event = torch.cuda.current_stream().record_event()
        with self._cv:
            if self._stop:
                raise RuntimeError("transfer engine is closed")
            if urgent:
                # after the urgent ones already queued, before every prefetch
                pos = next((i for i, q in enumerate(self._queue) if not q.urgent), len(self._queue))
                self._queue.insert(pos, t)
            else:
                self._queue.append(t)
            self._cv.notify()
        return t

    def cancel(self, t: Transfer) -> bool:
        """Remove a queued transfer; False if the link already started it."""
        with self._cv:
            try:
                self._queue.remove(t)
            except ValueError:
                return False
        t.cancelled = True
        t.done.set()
        return True

    def wait(self, t: Transfer) -> bool:
        """Block until t is done; a dead worker or `timeout_s` without progress raise TransferError."""
        deadline = time.monotonic() + self.timeout_s
        while not t.done.wait(0.05):
            if not self._thread.is_alive():
                raise TransferError(f"the transfer worker died ({self.dead or 'no reason given'}) while expert "
                                    f"{t.e} of MoE layer {t.m} was queued; the transfer will never arrive")
            if time.monotonic() > deadline:
                raise TransferError(f"expert {t.e} of MoE layer {t.m} did not arrive within {self.timeout_s:.0f} s "
                                    f"(a store read that blocks?); raise OffloadConfig.transfer_timeout_s if "
                                    "the link is really that slow")
        return t.ok

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # SystemExit, KeyboardInterrupt, ...: fail everything, loudly
            self.dead = repr(exc)
            with self._cv:
                pending, self._queue = list(self._queue), collections.deque()
                running, self._running = self._running, None
            for t in pending + ([running] if running is not None else []):
                t.error = f"transfer worker died: {self.dead}"
                t.done.set()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                t = self._queue.popleft()
                t.t_start = time.perf_counter()
                self._running = t
            try:
                if self.fault is not None and self.fault(t.m, t.e):
                    raise IOError(f"injected fault on expert {t.e} of MoE layer {t.m}")
                if self._cuda:
                    with torch.cuda.stream(self._stream):
                        self._stream.wait_event(t.cuda_event)
                        self._writer.write(t.m, t.e, t.slot, t.spec, non_blocking=True)
                    self._stream.synchronize()
                else:
                    self._writer.write(t.m, t.e, t.slot, t.spec, non_blocking=False)
                t.ok = True
            except Exception as exc:  # a failed transfer is reported, never raised on this thread
                t.error = repr(exc)
            hold = t.t_start + self.link.transfer_time(t.nbytes) - time.perf_counter()
            if hold > 0:
                time.sleep(hold)
            t.t_end = time.perf_counter()
            with self._cv:
                self._running = None
            t.done.set()

    def backlog_s(self) -> float:
        """Link time of the queued transfers plus what is left of the running one."""
        with self._cv:
            queued = sum(self.link.transfer_time(q.nbytes) for q in self._queue)
            r = self._running
            if r is not None and r.t_start is not None:
                queued += max(0.0, r.t_start + self.link.transfer_time(r.nbytes) - time.perf_counter())
        return queued

    def close(self) -> None:
        """Stop the worker and cancel what is still queued; joins the thread."""
        with self._cv:
            self._stop = True
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for t in pending:
            t.cancelled = True
            t.done.set()
        self._thread.join(timeout=5.0)  # a worker stuck in a store read must not hang close()

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads this engine started."""
        return [self._thread]


class CudaCopyEngine(TransferEngine):
    """Native CUDA back end: non-blocking copies from pinned memory on a dedicated stream."""

    def __init__(self, store: HostStore, slots: DeviceSlots, fault: Callable[[int, int], bool] | None = None):
        if slots.device.type != "cuda":  # (CUDA events complete or raise; no worker thread to die)
            raise ValueError("CudaCopyEngine needs slots on a CUDA device; use EmulatedEngine on CPU")
        self.fault = fault
        self._writer = SlotWriter(store, slots)
        self._stream = torch.cuda.Stream(slots.device)
        self._closed = False

    def submit(self, m: int, e: int, slot: int, urgent: bool = False, spec: QuantSpec | None = None) -> Transfer:
        """Issue the copies now on the copy stream (the stream keeps FIFO order; `urgent` is moot)."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        w = self._writer
        t = Transfer(m, e, slot, w.nbytes(m, e, spec), urgent, spec=spec)
        t.t_start = time.perf_counter()
        if self.fault is not None and self.fault(m, e):
            t.error = f"injected fault on expert {e} of MoE layer {m}"
            t.t_end = t.t_start
            t.done.set()
            return t
        self._stream.wait_stream(torch.cuda.current_stream())  # earlier kernels may read the slot
        with torch.cuda.stream(self._stream):
            w.write(m, e, slot, spec, non_blocking=True)
            t.cuda_event = self._stream.record_event()
        t.ok = True
        return t

    def cancel(self, t: Transfer) -> bool:
        """Issued copies cannot be recalled."""
        return False

    def poll(self, t: Transfer) -> bool:
        """Done once its event has completed (the compute stream is then ordered after it)."""
        if not t.done.is_set() and t.cuda_event is not None and t.cuda_event.query():
            self.wait(t)
        return t.done.is_set()

    def wait(self, t: Transfer) -> bool:
        """Block the host until the copy is done, and order the compute stream after it."""
        if t.cuda_event is not None and not t.done.is_set():
            t.cuda_event.synchronize()
            torch.cuda.current_stream().wait_event(t.cuda_event)
            t.t_end = time.perf_counter()
            t.done.set()
        t.done.set()
        return t.ok

    def close(self) -> None:
        """Finish outstanding copies."""
        if not self._closed:
            self._stream.synchronize()
            self._closed = True



@torch.no_grad()
def calibrate_layer_time(model: nn.Module, steps: int = 12) -> float:
    """Median seconds of one decoder layer in a batch-1 decode step of the model as it is now."""
    device = next(model.parameters()).device
    ids = torch.zeros(1, 8, dtype=torch.long, device=device)
    cache = model(input_ids=ids, use_cache=True)["cache"]
    nxt, times = ids[:, -1:], []
    for _ in range(max(2, steps)):
        t0 = time.perf_counter()
        model(input_ids=nxt, cache=cache, use_cache=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] / len(getattr(model, "model", model).layers)
