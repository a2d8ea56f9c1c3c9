"""Full-content digests of experts: what lets the SSD tier refuse to compute with weights that are not the model's.

What this file is: `expert_digest(w)`, a 64-bit xxHash (XXH3) over every byte of one expert's canonical
tensors (weights and biases, in the canonical layout, with their names, shapes and dtypes), and `first_difference`,
which says where two experts differ (tensor, first row, non-finite values) for an error message. XXH3 is a
non-cryptographic hash: it guards against edited, corrupted and swapped files, not against an adversary who
crafts a collision. Cost on this machine: `benchmarks/bench_load_offloaded.py` measures it per GB.
What it is not: a store; `store.SafetensorsStore` takes the digests once and re-checks every read.
"""
from __future__ import annotations

import torch
import xxhash

from fate_lab.model.experts import ExpertWeights


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Every byte of t in canonical (row-major) order, without a copy where t already is row-major."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def header(name: str, dtype: torch.dtype, shape) -> bytes:
    """What the digest hashes before tensor `name`'s bytes: its name, dtype and shape."""
    return f"{name}:{dtype}:{tuple(shape)};".encode()


def expert_digest(w: ExpertWeights) -> int:
    """XXH3-64 of one expert: each tensor's name, dtype, shape and bytes, in field order."""
    h = xxhash.xxh3_64()
    for name, t in w.tensors().items():
        h.update(header(name, t.dtype, t.shape))
        h.update(tensor_bytes(t.cpu()))
    return h.intdigest()


def first_difference(mine: ExpertWeights, theirs: ExpertWeights) -> tuple[str | None, str]:
    """(the field where theirs first differs from mine, or None, and in words: its first differing row and
    non-finite values)."""
    a, b = mine.tensors(), theirs.tensors()
    if a.keys() != b.keys():
        return None, f"it holds tensors {sorted(b)}, the model {sorted(a)}"
    for name in a:
        x, y = a[name].detach().cpu(), b[name].detach().cpu()
        if x.shape != y.shape or x.dtype != y.dtype:
            return name, f"{name} is {y.dtype} {tuple(y.shape)}, the model's {x.dtype} {tuple(x.shape)}"
        rows = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(-1, 1)
        other = y.reshape(rows.shape)
        differ = (rows != other).any(dim=1) | ~torch.isfinite(other).all(dim=1)  # (rows,)
        if bool(differ.any()):
            idx = differ.nonzero().reshape(-1)
            nonfinite = int((~torch.isfinite(other)).sum())
            note = f", {nonfinite} non-finite values (NaN/inf)" if nonfinite else ""
            return name, (f"{name} differs in {idx.numel()} of {rows.shape[0]} rows, the first at row {int(idx[0])}"
                          f"{note}")
    return None, "its bytes differ (same values: another byte pattern, e.g. -0.0 for 0.0 or another NaN payload)"


def nonfinite(w: ExpertWeights) -> str | None:
    """Which tensor of w holds NaN/inf values (and how many), or None when every value is finite."""
    for name, t in w.tensors().items():
        bad = int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
        if bad:
            return f"{name} holds {bad} non-finite values (NaN/inf)"
    return None
