"""Reads that bypass the page cache: O_DIRECT byte ranges of a file into preallocated aligned buffers.

What this file is: `DirectFile`, a file opened with O_DIRECT whose `read_into(offset, nbytes, buf)` reads any byte
range (rounded out to 4096-byte blocks, as O_DIRECT requires) into an aligned buffer and returns a view of the
asked bytes; `aligned_buffer(nbytes)`, page-aligned anonymous memory; and `DirectReader`, a pool of reader threads
(the queue depth) that reads a list of (path, offset, nbytes) ranges with each thread's own preallocated buffer.
Why O_DIRECT: a read through the page cache of a recently read file costs a memory copy, not a disk access, so a
link measured or run through it is not the disk. O_DIRECT is the one POSIX way to ask for the device itself on
every read; where the file system refuses it (some overlay and network mounts) `DirectFile` raises one clear error:
there is no silent buffered fallback, because it would measure the wrong link.
What it is not: it knows nothing of experts or safetensors (the caller gives the byte ranges) and checks no digest
(the caller does, as `store.py` does for the SSD tier).
"""
from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ALIGN = 4096  # O_DIRECT's alignment of offset, length and buffer address on Linux block devices (4 KiB sectors)


def _round_down(x: int) -> int:
    return x - x % ALIGN


def _round_up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous memory of nbytes rounded up to ALIGN; mmap returns page-aligned memory, as O_DIRECT needs."""
    if not (isinstance(nbytes, int) and nbytes > 0):
        raise ValueError(f"nbytes={nbytes!r}; give an int > 0")
    return mmap.mmap(-1, _round_up(nbytes))


def span(offset: int, nbytes: int) -> int:
    """Bytes an O_DIRECT read of [offset, offset + nbytes) moves: the range rounded out to ALIGN blocks."""
    return _round_up(offset + nbytes) - _round_down(offset)


class DirectFile:
    """One file opened with O_DIRECT for reading; `read_into` reads a byte range through an aligned buffer."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not hasattr(os, "O_DIRECT"):
            raise OSError(f"{self.path}: this platform has no O_DIRECT; the disk link needs it to bypass the "
                          f"page cache")
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.path}: the file is gone; the disk link reads experts from it") from None
        except OSError as e:
            raise OSError(f"{self.path}: the file system refused O_DIRECT ({e.strerror}); put the checkpoint on a "
                          f"disk (not tmpfs) to read it with the page cache bypassed") from None
        self.size = os.fstat(self.fd).st_size

    def read_into(self, offset: int, nbytes: int, buf: mmap.mmap) -> memoryview:
        """The bytes [offset, offset + nbytes) of the file, read with O_DIRECT into buf; a view into buf."""
        if offset < 0 or nbytes <= 0:
            raise ValueError(f"{self.path}: bad range offset={offset}, nbytes={nbytes}")
        if offset + nbytes > self.size:
            raise OSError(f"{self.path}: the range [{offset}, {offset + nbytes}) is past the file's end "
                          f"({self.size} bytes); the file is truncated or not the one indexed")
        start = _round_down(offset)
        length = span(offset, nbytes)
        if len(buf) < length:
            raise ValueError(f"{self.path}: a buffer of {len(buf)} bytes for a read of {length}")
        view = memoryview(buf)[:length]
        got = os.preadv(self.fd, [view], start)
        if got < offset - start + nbytes:
            raise OSError(f"{self.path}: read {got} bytes at {start}, wanted {offset - start + nbytes}; "
                          f"the file shrank while it was read")
        return memoryview(buf)[offset - start: offset - start + nbytes]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DirectReader:
    """queue_depth reader threads, each with its own aligned buffer of max_bytes; `read` returns copies of ranges.

    Files are opened once per thread and kept; `read(ranges)` reads a list of (path, offset, nbytes) with up to
    queue_depth reads in flight and returns their bytes in order. An error in any read (a vanished, truncated or
    refused file) is raised from `read` as it is, after every read of the call has ended: nothing hangs.
    """

    def __init__(self, queue_depth: int, max_bytes: int) -> None:
        if not (isinstance(queue_depth, int) and queue_depth >= 1):
            raise ValueError(f"queue_depth={queue_depth!r}; give an int >= 1 (reads in flight)")
        self.queue_depth = queue_depth
        self.max_bytes = max_bytes
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="direct-read")

    def _read_one(self, path: str, offset: int, nbytes: int) -> bytes:
        loc = self._local
        if not hasattr(loc, "files"):
            loc.files, loc.buf = {}, aligned_buffer(self.max_bytes + 2 * ALIGN)
        f = loc.files.get(path)
        if f is None:
            f = loc.files[path] = DirectFile(path)
        if span(offset, nbytes) > len(loc.buf):
            raise ValueError(f"{path}: a read of {nbytes} bytes exceeds the reader's max_bytes={self.max_bytes}")
        try:
            return bytes(f.read_into(offset, nbytes, loc.buf))
        except OSError:
            f.close()
            del loc.files[path]
            raise

    def read(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        futures = [self._pool.submit(self._read_one, str(p), o, n) for p, o, n in ranges]
        errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
