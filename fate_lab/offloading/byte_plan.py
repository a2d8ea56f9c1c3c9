"""Reading an expert from the disk straight into its slot: where each byte of a read goes, worked out once.

Why: a disk read by default rebuilds the expert as tensors (transformers' conversions on the bytes read), hashes them
and copies them into the slot: about 60 small Python steps per read, each taking the interpreter lock. The readers
run on threads beside the compute thread, which needs that lock for every torch call it makes, so on the 2-core test
machine one busy reader makes the decode forwards 2.3-3.0x slower. With `OffloadConfig(direct_reads=True)` a plan
moves the bytes with a few numpy copies and one XXH3 pass, which release the lock (`benchmarks/bench_disk_reader.py`,
docs/disk.md).

What this file is:
- `derive(index, m, e, ranges, canon)`: the `BytePlan` of one expert of the checkpoint: which bytes of its O_DIRECT
  reads (`DiskStore.ranges[m][e]`, one list per file) land where in each canonical tensor. It runs the index's own
  read (transformers' conversions included) on integer tensors that number every element read, so whatever the
  conversions do (stack, concatenate, slice, transpose), the result says where each element came from. A plan
  exists only where the bytes move unchanged or widen exactly (the file's dtype is the canonical one, or bfloat16 /
  float16 into float32, as the embedded models run), and each tensor is at most `MAX_COPIES` contiguous runs (a
  transposed layout is not: it keeps the conversion path).
- `BytePlan.read_into(ranges, buf, regions)`: the reads, the copies into `regions` (the slot's bytes of each
  canonical tensor, as `DeviceSlots.regions` gives them), and the XXH3-64 digest of the result, computed exactly as
  `digest.expert_digest` computes it of the canonical tensors, so that the digests taken at offload check it.
What it is not: the decision to use a plan (`disk.DiskStore` checks every layer's plan against its conversion path
at open) or the slot layout (`slots.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from fate_lab.offloading.digest import header
from fate_lab.offloading.direct import read_ranges, span

COPY, BF16_F32, F16_F32 = 0, 1, 2  # how a run's elements land: as they are, or widened to float32 exactly as torch does
WIDEN = {(torch.bfloat16, torch.float32): BF16_F32, (torch.float16, torch.float32): F16_F32}
MAX_COPIES = 64  # contiguous runs per tensor beyond which a plan is refused (a transpose makes one per element)


@dataclass(frozen=True)
class BytePlan:
    """One expert's bytes from its reads into its canonical tensors: `copies` (tensor name, byte offset in the
    tensor, read index, byte offset in that read, elements, how: `COPY` or a widening to float32), `headers`
    (tensor name, what the digest hashes before its bytes) in field order, and `tensors` (each canonical tensor's
    name, dtype and bytes). Experts of one layer whose reads have the same `structure` share a plan."""

    copies: tuple[tuple[str, int, int, int, int, int], ...]
    headers: tuple[tuple[str, bytes], ...]
    tensors: tuple[tuple[str, torch.dtype, int], ...]

    def fits(self, regions: dict[str, tuple[np.ndarray, torch.dtype]]) -> bool:
        """Do regions hold exactly these tensors (names, dtypes and sizes)?"""
        if len(regions) != len(self.tensors):
            return False
        for name, dtype, n in self.tensors:
            r = regions.get(name)
            if r is None or r[1] != dtype or r[0].size != n:
                return False
        return True

    def read_into(self, ranges: dict[Path, list[tuple]], buf: np.ndarray,
                  regions: dict[str, tuple[np.ndarray, torch.dtype]]) -> int:
        """Read ranges (`DiskStore.ranges[m][e]`) with O_DIRECT into buf, copy into regions (name: a uint8 view of
        the destination tensor, its dtype; `fits` them first); returns the XXH3-64 digest of what landed."""
        raw, pos = [], 0
        for file, rs in ranges.items():
            views = read_ranges(file, [(r[2], r[3]) for r in rs], buf[pos:])
            raw += [np.frombuffer(v, dtype=np.uint8) for v in views]
            pos += span([(r[2], r[3]) for r in rs])
        for name, dst, k, src, n, how in self.copies:
            out = regions[name][0]
            if how == COPY:
                size = regions[name][1].itemsize
                out[dst:dst + n * size] = raw[k][src:src + n * size]
            elif how == BF16_F32:  # a bfloat16 is the upper half of the float32 of the same value, NaN payloads too
                np.left_shift(raw[k][src:src + 2 * n].view(np.uint16), np.uint32(16),
                              out=out[dst:dst + 4 * n].view(np.uint32), dtype=np.uint32)
            else:  # F16_F32: numpy's own half-to-float conversion
                np.copyto(out[dst:dst + 4 * n].view(np.float32), raw[k][src:src + 2 * n].view(np.float16))
        h = xxhash.xxh3_64()
        for name, head in self.headers:
            h.update(head)
            h.update(regions[name][0])
        return h.intdigest()


def structure(ranges: dict[Path, list[tuple]]) -> tuple:
    """What must be equal for two experts to share a plan: each read's dtype and shape, in order."""
    return tuple((r[4], tuple(r[5])) for rs in ranges.values() for r in rs)


def derive(index, m: int, e: int, ranges: dict[Path, list[tuple]],
           canon: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> BytePlan | str:
    """The plan of expert e of MoE layer m, or why there is none. canon: each canonical tensor's (dtype, shape)
    as the conversion path gives them (field order)."""
    marks, starts, dtypes = {}, [], []
    base = 0
    for file, rs in ranges.items():
        for r in rs:
            n = math.prod(r[5])
            marks[file, r[0], r[1]] = torch.arange(base, base + n, dtype=torch.int64).reshape(r[5])
            starts.append(base)
            dtypes.append(r[4])
            base += n + 1  # a gap: a run never continues from one read into the next
    try:
        w = index.read(m, e, load=lambda file, key, ee=None: marks[file, key, ee], cast=False)
    except Exception as exc:  # a conversion that does arithmetic cannot run on element numbers
        return f"its conversion does not run on element numbers ({type(exc).__name__}: {exc})"
    got = w.tensors()
    if list(got) != list(canon):
        return f"its tensors {list(got)} differ from the conversion path's {list(canon)}"
    bounds = np.asarray(starts + [base], dtype=np.int64)
    copies = []
    for name, t in got.items():
        dtype, shape = canon[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != torch.int64:
            return f"{name}: traced as {t.dtype} {tuple(t.shape)}, not {tuple(shape)}"
        ids = t.contiguous().reshape(-1).numpy()
        cut = np.flatnonzero(np.diff(ids) != 1) + 1
        lo = np.concatenate([[0], cut]).astype(np.int64)
        hi = np.concatenate([cut, [ids.size]]).astype(np.int64)
        if lo.size > MAX_COPIES:
            return f"{name} is {lo.size} separate runs of the file (a transposed or interleaved layout)"
        size = dtype.itemsize
        for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
            first, last = int(ids[a]), int(ids[b - 1])
            k = int(np.searchsorted(bounds, first, side="right")) - 1
            if not 0 <= k < len(starts) or last >= bounds[k + 1]:
                return f"{name}: a run crosses two reads"
            how = WIDEN.get((dtypes[k], dtype), COPY if dtypes[k] == dtype else None)
            if how is None:
                return f"{name} is {dtype} but the file holds {dtypes[k]}: a conversion numpy cannot do exactly"
            copies.append((name, a * size, k, (first - starts[k]) * dtypes[k].itemsize, b - a, how))
    headers = tuple((name, header(name, *canon[name])) for name in canon)
    sizes = tuple((name, dtype, math.prod(shape) * dtype.itemsize) for name, (dtype, shape) in canon.items())
    return BytePlan(tuple(copies), headers, sizes)
