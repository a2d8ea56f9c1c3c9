"""Reads that bypass the page cache: O_DIRECT preads of byte ranges into page-aligned buffers.

What this file is: `read_ranges(path, ranges, buf)`, which opens a file with O_DIRECT, reads the aligned
blocks covering each (offset, nbytes) range into `buf` (one pread per run of ranges that lie within one
block of each other) and returns a view of each range's bytes, and `aligned_buffer(nbytes)`, page-aligned
anonymous memory to read into. O_DIRECT is used because it provably bypasses the page cache (the kernel
DMAs straight into the caller's buffer); `posix_fadvise(DONTNEED)` only asks the kernel to drop pages and
a concurrent reader can bring them back. When the file system refuses O_DIRECT (tmpfs, some overlays) the
read fails with `DirectIOError` naming the path: there is no silent fallback to buffered reads, which
would measure memory instead of the disk. The file is opened for every read, so a file that vanished or
was truncated since is noticed at the next read.

What it is not: no cache, no thread, no digest (the disk store `disk.py` checks what these reads return).
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

ALIGN = 4096  # bytes: offset, length and buffer address of an O_DIRECT read are multiples of this


class DirectIOError(OSError):
    """An O_DIRECT read failed: the file vanished, is shorter than the range, or refuses O_DIRECT."""


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer of at least nbytes (anonymous mmap), rounded up to ALIGN."""
    size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    return np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)


def span(ranges: list[tuple[int, int]]) -> int:
    """Bytes of buffer `read_ranges` needs for ranges (their aligned blocks, merged)."""
    return sum(end - start for start, end, _ in _runs(ranges))


def _runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """Aligned (start, end, [range indices]) runs, merging ranges whose blocks touch or overlap."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    runs: list[tuple[int, int, list[int]]] = []
    for i in order:
        off, n = ranges[i]
        start, end = off // ALIGN * ALIGN, -(-(off + n) // ALIGN) * ALIGN
        if runs and start <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end), runs[-1][2] + [i])
        else:
            runs.append((start, end, [i]))
    return runs


def open_direct(path: str | Path) -> int:
    """A read-only O_DIRECT file descriptor of path (DirectIOError if it vanished or refuses O_DIRECT)."""
    if not hasattr(os, "O_DIRECT"):
        raise DirectIOError(f"{path}: this OS has no O_DIRECT (Linux only); the disk link cannot bypass the page cache")
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT)
    except FileNotFoundError as exc:
        raise DirectIOError(f"{path}: the file vanished ({exc.strerror})") from exc
    except OSError as exc:
        raise DirectIOError(f"{path}: cannot open with O_DIRECT ({exc.strerror}); the file system (tmpfs, an "
                            "overlay?) refuses reads that bypass the page cache: put the checkpoint on a real disk"
                            ) from exc


def read_ranges(path: str | Path, ranges: list[tuple[int, int]], buf: np.ndarray) -> list[memoryview]:
    """Each (offset, nbytes) range of path read with O_DIRECT into buf (aligned, >= span(ranges) bytes);
    returns one memoryview per range, in the given order, into buf (valid until buf is reused)."""
    runs = _runs(ranges)
    need = sum(end - start for start, end, _ in runs)
    if buf.nbytes < need:
        raise ValueError(f"buffer of {buf.nbytes} bytes; these reads need {need}")
    fd = open_direct(path)
    out: list[memoryview | None] = [None] * len(ranges)
    mv, pos = memoryview(buf), 0
    try:
        for start, end, members in runs:
            try:
                got = os.preadv(fd, [mv[pos:pos + end - start]], start)
            except OSError as exc:
                raise DirectIOError(f"{path}: O_DIRECT read of bytes {start}..{end} failed ({exc.strerror})") from exc
            for i in members:
                off, n = ranges[i]
                if off + n - start > got:
                    raise DirectIOError(f"{path}: truncated: bytes {off}..{off + n} lie past its end (read "
                                        f"{got} of {end - start} bytes at {start}); the file changed on disk")
                out[i] = mv[pos + off - start:pos + off - start + n]
            pos += end - start
    finally:
        os.close(fd)
    return out  # type: ignore[return-value]
