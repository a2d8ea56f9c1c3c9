"""The disk link: every expert that moves is read from the checkpoint's safetensors files, page cache bypassed.

What this file is:
- `DiskStore`: the SSD tier (`store.SafetensorsStore`: verified in full at open, every read digest-checked)
  whose reads are O_DIRECT preads (`direct.py`) of exactly the byte ranges of one expert's tensors, into a
  page-aligned buffer each reading thread allocates once. The byte ranges come from the safetensors headers
  of the files `ExpertIndex` maps each expert to (per-expert keys, or one row of a fused [E, ...] tensor).
  Transformers' own conversions run on the bytes read (`fetch`), as for every other read of the index; with
  `OffloadConfig(direct_reads=True)` and slots in host memory, an expert whose layer has a byte plan
  (`byte_plan.py`: worked out at open by tracing those conversions, and checked there against them) goes straight
  into the slot's bytes instead (`read_into`): a few numpy copies and one XXH3 pass, which release the interpreter
  lock. `describe()` names the layers without a plan.
- `DiskEngine`: the transfer engine of `link="disk"`: `queue_depth` reader threads (the link profile's) take
  transfers from one queue (urgent ones first), each reads its expert from the disk and copies it into its
  slot. Nothing sleeps: the time a transfer takes is the disk's.
What it is not: no emulation (the link profile only sizes the queue and the prefetch budget), no page-cache
reader (a buffered read would time memory, not the disk), and no packed copies: a quantized preset reads them
from the file `packed_file.DiskQuantizedStore` writes once, with the same O_DIRECT reads.
"""
from __future__ import annotations

import collections
import itertools
import json
import struct
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from fate_lab.hardware.links import LinkProfile
from fate_lab.offloading.byte_plan import BytePlan, derive, structure
from fate_lab.offloading.digest import tensor_bytes
from fate_lab.offloading.direct import aligned_buffer, read_ranges, span
from fate_lab.offloading.slots import DeviceSlots, SlotWriter
from fate_lab.offloading.store import CheckpointError, HostStore, SafetensorsStore
from fate_lab.offloading.transfer import DEFAULT_TIMEOUT_S, Transfer, TransferEngine, TransferError

__all__ = ["DiskEngine", "DiskStore", "safetensors_header"]

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
_IDS = itertools.count()


def safetensors_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, {key: {dtype, shape, data_offsets}}) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


class DiskStore(SafetensorsStore):
    """The SSD tier read with O_DIRECT: one expert's byte ranges per read, each read digest-checked."""

    tier = "disk"

    @classmethod
    def open(cls, adapter, checkpoint, index=None, progress: bool = False) -> DiskStore:
        """Verified as `SafetensorsStore.open`, then every expert's byte ranges located from the file headers."""
        base = SafetensorsStore.open(adapter, checkpoint, index=index, progress=progress)
        store = cls(base.index, base.num_moe_layers, base.num_experts, base.digests, base.reference)
        store._locate()
        store.plans, store.no_plan = None, {}  # derived on demand: `plan()` (direct reads only)
        return store

    def _locate(self) -> None:
        """ranges[m][e]: {file: [(key, e or None, offset, nbytes, dtype, shape)]}; span: the largest read."""
        headers: dict[Path, tuple[int, dict]] = {}
        self.ranges: list[list[dict[Path, list[tuple]]]] = []
        for m in range(self.num_moe_layers):
            row = []
            for e in range(self.num_experts):
                seen: dict[Path, list[tuple]] = {}

                def record(file: Path, key: str, ee: int | None = None, seen=seen) -> torch.Tensor:
                    if file not in headers:  # parsed once per file (a big checkpoint's header is megabytes)
                        headers[file] = safetensors_header(file)
                    start, header = headers[file]
                    info = header[key]
                    dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
                    lo, hi = info["data_offsets"]
                    if ee is not None:  # one row of a fused [E, ...] tensor, kept as a stack of one
                        rows = (hi - lo) // shape[0]
                        lo, hi, shape = lo + ee * rows, lo + (ee + 1) * rows, (1, *shape[1:])
                    seen.setdefault(file, []).append((key, ee, start + lo, hi - lo, dtype, shape))
                    return torch.zeros(shape, dtype=dtype)

                self.index.read(m, e, load=record)
                row.append(seen)
            self.ranges.append(row)
        self.span = max(sum(span([(r[2], r[3]) for r in rs]) for rs in by_file.values())
                        for row in self.ranges for by_file in row)

    def plan(self) -> None:
        """Derive `plans[m][e]`, expert e's `byte_plan.BytePlan` (None: read through the conversion path), once: one
        per distinct read structure of a layer, checked at once against that path on the layer's first such expert
        (the same bytes, and the digest taken at offload); `no_plan`: why a layer has none. Called by a disk engine
        asked for direct reads, so the default path pays nothing for it."""
        if self.plans is not None:
            return
        plans: list[list[BytePlan | None]] = []
        buf = aligned_buffer(self.span)
        for m in range(self.num_moe_layers):
            known: dict[tuple, BytePlan | None] = {}
            row = []
            for e in range(self.num_experts):
                key = structure(self.ranges[m][e])
                if key not in known:
                    known[key] = self._checked_plan(m, e, buf)
                row.append(known[key])
            plans.append(row)
        self.plans = plans

    def _checked_plan(self, m: int, e: int, buf) -> BytePlan | None:
        ref = self.fetch(m, e).tensors()  # the conversion path, digest-checked
        canon = {name: (t.dtype, tuple(t.shape)) for name, t in ref.items()}
        plan = derive(self.index, m, e, self.ranges[m][e], canon)
        if isinstance(plan, str):
            self.no_plan.setdefault(m, plan)
            return None
        scratch = {name: (np.empty(t.numel() * t.element_size(), dtype=np.uint8), t.dtype) for name, t in ref.items()}
        digest = plan.read_into(self.ranges[m][e], buf, scratch)
        same = all(np.array_equal(scratch[name][0], np.frombuffer(tensor_bytes(t), dtype=np.uint8))
                   for name, t in ref.items())
        if digest != self.digests[m][e] or not same:  # a conversion the trace misread: keep the conversion path
            self.no_plan.setdefault(m, "its traced plan did not reproduce the conversion's bytes")
            return None
        return plan

    def read_into(self, m: int, e: int, spec, regions: dict) -> bool:
        """Expert e of MoE layer m read with O_DIRECT straight into regions (a slot's bytes: `DeviceSlots.regions`)
        by its byte plan, and refused unless it hashes to its digest; False (nothing read) where it has no plan or
        the regions are not its tensors, or `plan()` was not called: the caller then reads it through `fetch`."""
        plan = self.plans[m][e] if spec is None and self.plans is not None else None
        if plan is None or not plan.fits(regions):
            return False
        try:
            digest = plan.read_into(self.ranges[m][e], self.buffer(), regions)
        except Exception as exc:  # a vanished, truncated or replaced file: name it and the expert
            raise CheckpointError(f"cannot read expert {e} of MoE layer {m} from {self._where(m, e)}: {exc}; the "
                                  "checkpoint changed or vanished while offloaded") from exc
        if digest != self.digests[m][e]:
            self.fetch(m, e)  # the conversion path's own check names what changed (CheckpointError)
            raise RuntimeError(f"expert {e} of MoE layer {m}: its byte plan read other bytes than the conversion "
                               "path (a fate_lab bug; the slot was not used)")
        return True

    def buffer(self):
        """This thread's aligned read buffer (allocated at its first read, then reused)."""
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = aligned_buffer(self.span)
        return buf

    def expert_nbytes(self, m: int, e: int) -> int:
        """Bytes of the checkpoint a read of (m, e) needs (before alignment)."""
        return sum(r[3] for rs in self.ranges[m][e].values() for r in rs)

    def fetch(self, m: int, e: int):
        """Expert e of MoE layer m read from disk with O_DIRECT, refused unless it hashes to its digest. The
        tensors are views of this thread's buffer: copy them before this thread reads again."""
        buf, pos, tensors = self.buffer(), 0, {}
        try:
            for file, rs in self.ranges[m][e].items():
                views = read_ranges(file, [(r[2], r[3]) for r in rs], buf[pos:])
                for r, v in zip(rs, views, strict=True):
                    tensors[file, r[0], r[1]] = torch.frombuffer(v, dtype=r[4]).reshape(r[5])
                pos += span([(r[2], r[3]) for r in rs])
            w = self.index.read(m, e, load=lambda file, key, ee=None: tensors[file, key, ee])
        except Exception as exc:  # a vanished, truncated or replaced file: name it and the expert
            raise CheckpointError(f"cannot read expert {e} of MoE layer {m} from {self._where(m, e)}: {exc}; the "
                                  "checkpoint changed or vanished while offloaded") from exc
        return self._verified(m, e, w)

    def describe(self) -> str:
        """'disk O_DIRECT (<path>)', and which layers are read through the conversion path."""
        if not self.no_plan:
            return f"disk O_DIRECT ({self.path})"
        m, why = next(iter(self.no_plan.items()))
        return (f"disk O_DIRECT ({self.path}; {len(self.no_plan)} of {self.num_moe_layers} MoE layers read through "
                f"transformers' conversion, e.g. layer {m}: {why})")


class DiskEngine(TransferEngine):
    """`queue_depth` reader threads; each transfer is a real disk read plus the copy into its slot."""

    def __init__(self, store: HostStore, slots: DeviceSlots, link: LinkProfile,
                 fault: Callable[[int, int], bool] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 direct: bool = False):
        """direct: read each expert straight into its slot by its byte plan where it has one (`SlotWriter`)."""
        self.link, self.fault, self.timeout_s = link, fault, timeout_s
        self.dead: str | None = None
        self._writer = SlotWriter(store, slots, direct)
        self._disk = getattr(store, "base", store)
        if direct and hasattr(self._disk, "plan"):
            self._disk.plan()  # the byte plans, derived and checked before the first read
        self._cuda = slots.device.type == "cuda"
        self._queue: collections.deque[Transfer] = collections.deque()
        self._running: set[Transfer] = set()
        self._cv = threading.Condition()
        self._stop = False
        n = next(_IDS)
        self._threads = [threading.Thread(target=self._run, name=f"fate-disk-{n}-{i}", daemon=True)
                         for i in range(link.queue_depth)]
        for t in self._threads:
            t.start()

    def submit(self, m: int, e: int, slot: int, urgent: bool = False, spec=None) -> Transfer:
        """Queue a read; urgent ones (on-demand loads) go after the urgent ones queued, before every prefetch."""
        if self.dead is not None:
            raise TransferError(f"a disk reader died ({self.dead}); cannot move expert {e} of MoE layer {m}")
        t = Transfer(m, e, slot, self._writer.nbytes(m, e, spec), urgent, spec=spec)
        if self._cuda:
            t.cuda_event = torch.cuda.current_stream().record_event()
        with self._cv:
            if self._stop:
                raise RuntimeError("transfer engine is closed")
            if urgent:
                pos = next((i for i, q in enumerate(self._queue) if not q.urgent), len(self._queue))
                self._queue.insert(pos, t)
            else:
                self._queue.append(t)
            self._cv.notify()
        return t

    def cancel(self, t: Transfer) -> bool:
        """Remove a queued read; False once a reader took it."""
        with self._cv:
            try:
                self._queue.remove(t)
            except ValueError:
                return False
        t.cancelled = True
        t.done.set()
        return True

    def wait(self, t: Transfer) -> bool:
        """Block until t is done; dead readers or `timeout_s` without it raise TransferError."""
        deadline = time.monotonic() + self.timeout_s
        while not t.done.wait(0.05):
            if not any(th.is_alive() for th in self._threads):
                raise TransferError(f"the disk readers died ({self.dead or 'no reason given'}) while expert {t.e} "
                                    f"of MoE layer {t.m} was queued; the transfer will never arrive")
            if time.monotonic() > deadline:
                raise TransferError(f"expert {t.e} of MoE layer {t.m} did not arrive from the disk within "
                                    f"{self.timeout_s:.0f} s; raise OffloadConfig.transfer_timeout_s if the disk "
                                    "is really that slow")
        return t.ok

    def _run(self) -> None:
        try:
            if hasattr(self._disk, "buffer"):
                self._disk.buffer()  # this reader's aligned buffer, allocated before the first transfer
            self._serve()
        except BaseException as exc:  # fail everything queued, loudly
            self.dead = repr(exc)
            with self._cv:
                pending, self._queue = list(self._queue), collections.deque()
            for t in pending:
                t.error = f"disk reader died: {self.dead}"
                t.done.set()

    def _serve(self) -> None:
        stream = torch.cuda.Stream(self._writer.slots.device) if self._cuda else None
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                t = self._queue.popleft()
                t.t_start = time.perf_counter()
                self._running.add(t)
            try:
                if self.fault is not None and self.fault(t.m, t.e):
                    raise IOError(f"injected fault on expert {t.e} of MoE layer {t.m}")
                if stream is not None:  # read into this thread's host buffer, then copy and wait for it
                    with torch.cuda.stream(stream):
                        stream.wait_event(t.cuda_event)
                        self._writer.write(t.m, t.e, t.slot, t.spec, non_blocking=False)
                    stream.synchronize()
                else:
                    self._writer.write(t.m, t.e, t.slot, t.spec, non_blocking=False)
                t.ok = True
            except Exception as exc:  # reported on the transfer, never raised on this thread
                t.error = str(exc)
            t.t_end = time.perf_counter()
            with self._cv:
                self._running.discard(t)
            t.done.set()

    def backlog_s(self) -> float:
        """The profile's estimate of the queued reads' time, shared by the readers, plus the running ones' rest."""
        now = time.perf_counter()
        with self._cv:
            queued = sum(self.link.transfer_time(q.nbytes) for q in self._queue)
            running = sum(max(0.0, r.t_start + self.link.transfer_time(r.nbytes) - now) for r in self._running)
        return (queued + running) / self.link.queue_depth

    def load_now(self, m: int, e: int, slot: int, spec, timed: bool = True) -> float:
        """Synchronous read of (m, e) into slot on the calling thread (the disk's own time, never a hold)."""
        t0 = time.perf_counter()
        self._writer.write(m, e, slot, spec, non_blocking=False)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the readers and cancel what is queued; joins them (a reader stuck in a read cannot hang it)."""
        with self._cv:
            self._stop = True
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for t in pending:
            t.cancelled = True
            t.done.set()
        for th in self._threads:
            th.join(timeout=5.0)

    @property
    def threads(self) -> list[threading.Thread]:
        """The reader threads."""
        return list(self._threads)
