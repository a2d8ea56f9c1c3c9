"""Calibrating this machine's disk as a link: O_DIRECT random reads at several sizes and queue depths.

What this file is: `measure_disk(path)` times random, aligned O_DIRECT reads of a file (the page cache
bypassed, `offloading/direct.py`) for each read size and queue depth (that many threads reading at once), in
`ROUNDS` interleaved rounds, each sample its median round; `fit_disk(samples)` fits `hardware.links.LinkProfile`'s
model to them: at queue depth 1 a read takes latency + bytes / bandwidth (the latency: the median over read sizes);
deeper queues overlap the latencies, not the bandwidth (`LinkProfile.stream_bandwidth`). Medians, because on a
shared machine one disturbed moment must not become the disk's profile: a single pass with a mean over sizes once
gave 16 ms per read where the same disk, minutes later, gave 0.05-0.18 ms. `calibrate_disk(path)` does both, picks
the queue depth that reads an expert-sized block fastest, and reads the device's read-ahead window (`readahead_of`:
what an mmap fault reads, from /sys/dev/block). `python -m fate_lab calibrate-disk [PATH]` prints the result.
What it is not: a benchmark of the runtime (`benchmarks/bench_disk.py` is), and no reading through the page
cache: a file system that refuses O_DIRECT is an error, not a fallback.
"""
from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fate_lab.hardware.disks import READAHEAD_BYTES, Disk
from fate_lab.offloading.direct import ALIGN, aligned_buffer, open_direct

SIZES = (64 << 10, 192 << 10, 384 << 10, 1 << 20, 4 << 20)  # bytes per read: around the embedded experts' sizes
QUEUE_DEPTHS = (1, 2, 4)
ROUNDS = 3  # interleaved rounds of every (size, queue depth); each sample is its median round


@dataclass(frozen=True)
class DiskSample:
    """Reads of `size` bytes at `queue_depth` in flight: how many, and the wall seconds they took (the median
    round's seconds per read times `reads`); `per_read`: each round's seconds per read, in the order measured."""

    size: int
    queue_depth: int
    reads: int
    seconds: float
    per_read: tuple[float, ...] = ()

    @property
    def throughput(self) -> float:
        """Bytes/s over the whole sample."""
        return self.size * self.reads / self.seconds


def measure_disk(path: str | Path, sizes=SIZES, queue_depths=QUEUE_DEPTHS, budget_bytes: int = 48 << 20,
                 seed: int = 0, rounds: int = ROUNDS) -> list[DiskSample]:
    """Random aligned O_DIRECT reads of path: for each size and queue depth, about budget_bytes in all, split over
    `rounds` interleaved rounds (every size and depth once per round); each sample is its median round."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds!r}: measure at least one round")
    path = Path(path)
    length = path.stat().st_size
    if length < max(sizes) + ALIGN:
        raise ValueError(f"{path}: {length} bytes; calibrating needs a file of at least {max(sizes) + ALIGN} bytes")
    rng = random.Random(seed)
    per_read: dict[tuple[int, int], list[float]] = {(size, qd): [] for size in sizes for qd in queue_depths}
    counts: dict[tuple[int, int], int] = dict.fromkeys(per_read, 0)
    for _ in range(rounds):
        for size, qd in per_read:
            reads = max(8 * qd, budget_bytes // rounds // size)
            offsets = [rng.randrange(0, (length - size) // ALIGN) * ALIGN for _ in range(reads)]
            per_read[size, qd].append(_timed_reads(path, size, offsets, qd) / reads)
            counts[size, qd] += reads
    return [DiskSample(size, qd, counts[size, qd], float(np.median(t)) * counts[size, qd], tuple(t))
            for (size, qd), t in per_read.items()]


def _timed_reads(path: Path, size: int, offsets: list[int], qd: int) -> float:
    """Wall seconds for qd threads to read every offset (size bytes each) with O_DIRECT."""
    chunks = [offsets[i::qd] for i in range(qd)]
    bufs = [aligned_buffer(size) for _ in range(qd)]
    errors: list[BaseException] = []

    def reader(i: int) -> None:
        fd = open_direct(path)
        try:
            view = memoryview(bufs[i])[:size]
            for off in chunks[i]:
                os.preadv(fd, [view], off)
        except BaseException as exc:
            errors.append(exc)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(qd)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def readahead_of(path: str | Path) -> int | None:
    """The read-ahead window (bytes) of the block device that holds path: its queue's read_ahead_kb (a partition's
    is its disk's); None where path is on no block device (tmpfs, a network file system) or sysfs says nothing."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for queue in (dev / "queue", dev / ".." / "queue"):
        try:
            return int((queue / "read_ahead_kb").read_text().strip()) << 10
        except (OSError, ValueError):
            continue
    return None


def fit_disk(samples: list[DiskSample], read_bytes: int, name: str = "disk",
             readahead: int = READAHEAD_BYTES) -> Disk:
    """The `Disk` these samples fit, with the given read-ahead window. Bandwidth: the best throughput of reads of
    1 MiB or more at any queue depth (where latency no longer matters); latency: the fixed time per read at queue
    depth 1 given that bandwidth (the median over read sizes of seconds per read minus bytes / bandwidth: a median,
    so that one disturbed size does not set it); queue depth: the one that streams read_bytes-sized reads fastest
    (measured)."""
    one = [s for s in samples if s.queue_depth == 1]
    big = [s for s in samples if s.size >= 1 << 20]
    if not one or not big:
        raise ValueError("fitting needs queue-depth-1 samples and samples of reads of 1 MiB or more")
    bandwidth = max(s.throughput for s in big)
    latency = float(np.median([s.seconds / s.reads - s.size / bandwidth for s in one]))
    near = min({s.size for s in samples}, key=lambda size: abs(size - read_bytes))
    best = max((s for s in samples if s.size == near), key=lambda s: s.throughput)
    return Disk(name, float(bandwidth), max(0.0, latency),
                f"O_DIRECT random reads measured on this machine ({len(samples)} samples, fit_disk)",
                queue_depth=best.queue_depth, readahead=max(4096, readahead))


def calibrate_disk(path: str | Path, read_bytes: int = 384 << 10, **kwargs) -> tuple[Disk, list[DiskSample]]:
    """Measure path's disk and fit it: (Disk, samples); its read-ahead window is the device's (`readahead_of`),
    Linux's default where sysfs does not say."""
    samples = measure_disk(path, **kwargs)
    return fit_disk(samples, read_bytes, readahead=readahead_of(path) or READAHEAD_BYTES), samples
