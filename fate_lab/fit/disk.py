"""Calibrating this machine's disk as a link: O_DIRECT read times fitted to a fixed latency plus bytes / bandwidth.

What this file is: `fit_link(samples, ...)`, the least-squares fit of (read bytes, seconds per read) samples taken
with one read in flight to `latency + bytes / bandwidth`, returned as a `LinkProfile`; and `measure(path, ...)`,
which times O_DIRECT random reads of several sizes from a file (`offloading/direct.py`, so the page cache is
bypassed) and returns those samples.
What it is not: the runtime's disk link (it moves no expert) and not a benchmark of the queue depth's effect: the
profile's `queue_depth` is the reader count the caller will run with, and `LinkProfile.stream_bandwidth` models it.
"""
from __future__ import annotations

import os
import random
import time

import numpy as np

from fate_lab.hardware.links import LinkProfile
from fate_lab.offloading.direct import ALIGN, DirectFile, aligned_buffer

SIZES = (ALIGN, 16 * ALIGN, 64 * ALIGN, 96 * ALIGN, 256 * ALIGN)  # 4 KiB .. 1 MiB; 384 KiB is a tiny_moe expert


def fit_link(samples: list[tuple[int, float]], name: str = "disk", queue_depth: int = 1,
             source: str = "") -> LinkProfile:
    """LinkProfile from (bytes, seconds) samples of single reads: least squares of seconds = latency + bytes/bw."""
    if len({b for b, _ in samples}) < 2:
        raise ValueError(f"{len(samples)} samples of {len({b for b, _ in samples})} sizes; give at least two sizes")
    x = np.array([b for b, _ in samples], dtype=float)
    y = np.array([t for _, t in samples], dtype=float)
    slope, latency = np.polyfit(x, y, 1)
    if slope <= 0:
        raise ValueError(f"read time does not grow with size (slope {slope:.3g} s/byte); the samples are noise")
    return LinkProfile(name=name, bandwidth=float(1.0 / slope), latency=float(max(latency, 0.0)),
                       source=source, queue_depth=queue_depth)


def measure(path: str | os.PathLike, sizes: tuple[int, ...] = SIZES, reads: int = 32,
            seed: int = 0) -> list[tuple[int, float]]:
    """(bytes, seconds) of `reads` O_DIRECT reads at random aligned offsets of path, for each size, one at a time."""
    rng = random.Random(seed)
    buf = aligned_buffer(max(sizes))
    out = []
    with DirectFile(path) as f:
        for n in sizes:
            if n > f.size:
                raise ValueError(f"{path}: {f.size} bytes, smaller than a read of {n}; give a larger file")
            for _ in range(reads):
                off = rng.randrange(0, (f.size - n) // ALIGN + 1) * ALIGN
                t0 = time.perf_counter()
                f.read_into(off, n, buf)
                out.append((n, time.perf_counter() - t0))
    return out
