"""Packed expert copies written to a file once, so a quantized preset on the disk link reads fewer bytes.

What this file is:
- `write_packed(path, items)` lays each packed expert (`quant.PackedExpert` of one layer, expert and precision)
  out as one 4 KiB-aligned run of its tensors' bytes, so that loading it is one O_DIRECT read, and writes a JSON
  index beside it: each run's offset and length, each tensor's dtype and shape, and an XXH3-64 digest of the
  run. Both files are written under temporary names and renamed at the end, so an interrupted write leaves
  nothing that looks complete. The layout is our own, not safetensors, because safetensors orders tensors by
  dtype, which scatters one expert's codes and scales over the file.
- `PackedFile.open(path)` reads the index; `read(m, e, spec)` reads one run with O_DIRECT (`direct.py`) into the
  calling thread's aligned buffer and refuses bytes whose digest differs.
- `DiskQuantizedStore`: `store.QuantizedStore` for the disk link. It packs each expert once from the checkpoint
  into a file of a cache folder, named by a digest of the checkpoint's expert digests and the precisions, and
  then reads every packed copy from that file. Full-precision reads still come from the checkpoint.
What it is not: the quantizer (`quant/`), or a cache in RAM: no packed copy stays in memory.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import torch
import xxhash

from fate_lab.offloading.direct import ALIGN, aligned_buffer, read_ranges
from fate_lab.offloading.store import CheckpointError, HostStore, QuantizedStore
from fate_lab.quant.experts import PackedExpert
from fate_lab.quant.kernels import QuantizedTensor, QuantSpec

__all__ = ["DiskQuantizedStore", "PackedFile", "packed_dir", "write_packed"]

FORMAT = 1  # bump when the layout changes: a file of another format is rewritten, never misread
_DTYPES = {str(d): d for d in (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64)}
_PARTS = ("gate_up.packed", "gate_up.scale", "gate_up.zero", "down.packed", "down.scale", "down.zero")


def packed_dir() -> Path:
    """Where packed files go: $FATE_LAB_CACHE, else $XDG_CACHE_HOME/fate_lab, else ~/.cache/fate_lab; + /packed."""
    root = os.environ.get("FATE_LAB_CACHE")
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fate_lab"
    return Path(root) / "packed"


def _tensors(p: PackedExpert) -> dict[str, torch.Tensor]:
    out = {"gate_up.packed": p.gate_up.packed, "gate_up.scale": p.gate_up.scale, "gate_up.zero": p.gate_up.zero,
           "down.packed": p.down.packed, "down.scale": p.down.scale, "down.zero": p.down.zero}
    out.update(p.biases())
    return {k: t.detach().cpu().contiguous() for k, t in out.items()}


def write_packed(path: Path, items) -> None:
    """Write (m, e, spec, PackedExpert) items to path and its index path.json (layout: module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, index = path.with_name(path.name + ".part"), []
    pos = 0
    with open(tmp, "wb") as f:
        for m, e, spec, p in items:
            tensors, run = _tensors(p), bytearray()
            meta = []
            for name, t in tensors.items():
                run += bytes(-len(run) % 16)  # each tensor at a 16-byte offset, so it views as its dtype
                b = t.reshape(-1).view(torch.uint8).numpy().tobytes()
                meta.append([name, str(t.dtype), list(t.shape), len(run), len(b)])
                run += b
            index.append({"m": m, "e": e, "bits": spec.bits, "group_size": spec.group_size, "refine": spec.refine,
                          "offset": pos, "nbytes": len(run), "digest": xxhash.xxh3_64_intdigest(bytes(run)),
                          "gate_up_shape": list(p.gate_up.shape), "down_shape": list(p.down.shape), "tensors": meta})
            run += bytes(-len(run) % ALIGN)  # the next run starts aligned
            f.write(run)
            pos += len(run)
        f.flush()
        os.fsync(f.fileno())
    idx_tmp = path.with_name(path.name + ".json.part")
    idx_tmp.write_text(json.dumps({"format": FORMAT, "bytes": pos, "experts": index}))
    os.replace(tmp, path)
    os.replace(idx_tmp, path.with_name(path.name + ".json"))


class PackedFile:
    """A written packed file: its index, and one O_DIRECT read per packed expert."""

    def __init__(self, path: Path, runs: dict[tuple[int, int, QuantSpec], dict]):
        self.path, self.runs = path, runs
        self.span = max((-(-r["nbytes"] // ALIGN) + 1) * ALIGN for r in runs.values()) if runs else ALIGN
        self._local = threading.local()

    @classmethod
    def open(cls, path: Path) -> PackedFile | None:
        """The file at path, or None if it or its index is missing, of another format, or of another length."""
        idx = Path(path).with_name(Path(path).name + ".json")
        try:
            data = json.loads(idx.read_text())
            if data.get("format") != FORMAT or Path(path).stat().st_size != data["bytes"]:
                return None
            runs = {(r["m"], r["e"], QuantSpec(r["bits"], r["group_size"], r["refine"])): r for r in data["experts"]}
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return cls(Path(path), runs)

    def nbytes(self, m: int, e: int, spec: QuantSpec) -> int:
        """Bytes of the packed copy (tensors only, without the alignment padding)."""
        return self.runs[m, e, spec]["nbytes"]

    def _read(self, m: int, e: int, spec: QuantSpec) -> tuple[dict, np.ndarray]:
        """(the run's index entry, its bytes in this thread's buffer), digest-checked."""
        r = self.runs[m, e, spec]
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = aligned_buffer(self.span)
        (view,) = read_ranges(self.path, [(r["offset"], r["nbytes"])], buf)
        if xxhash.xxh3_64_intdigest(view) != r["digest"]:
            raise CheckpointError(f"the packed copy of expert {e} of MoE layer {m} at int{spec.bits} in {self.path} "
                                  "does not match its digest: the file changed since it was written; delete it and "
                                  "its .json to rewrite it")
        return r, np.frombuffer(view, dtype=np.uint8)

    def read_into(self, m: int, e: int, spec: QuantSpec, regions: dict) -> bool:
        """The packed copy of (m, e) at spec read and checked as `read`, then copied byte for byte into regions (a
        packed slot's segments: `PackedSlots.regions`); False (nothing read) if they are not its tensors."""
        r = self.runs.get((m, e, spec))
        if r is None or len(regions) != len(r["tensors"]):
            return False
        for name, dtype, _, _, n in r["tensors"]:
            got = regions.get(name)
            if got is None or got[0].size != n or str(got[1]) != dtype:
                return False
        r, raw = self._read(m, e, spec)
        for name, _, _, off, n in r["tensors"]:
            regions[name][0][:] = raw[off:off + n]
        return True

    def read(self, m: int, e: int, spec: QuantSpec) -> PackedExpert:
        """The packed copy of (m, e) at spec, read with O_DIRECT and digest-checked; its tensors are views of this
        thread's buffer (copy them before this thread reads again)."""
        r, raw = self._read(m, e, spec)
        t = {name: torch.from_numpy(raw[off:off + n]).view(_DTYPES[dtype]).reshape(shape)
             for name, dtype, shape, off, n in r["tensors"]}
        qt = lambda part, shape: QuantizedTensor(t[f"{part}.packed"], t[f"{part}.scale"], t[f"{part}.zero"],  # noqa: E731
                                                 tuple(shape), spec)
        return PackedExpert(qt("gate_up", r["gate_up_shape"]), qt("down", r["down_shape"]),
                            t.get("gate_up_bias"), t.get("down_bias"))


class DiskQuantizedStore(QuantizedStore):
    """Packed copies read from a file written once (module docstring) over the disk tier's checkpoint."""

    def __init__(self, base: HostStore, specs: list[tuple[QuantSpec | None, ...]], folder: Path | None = None,
                 progress: bool = False):
        self._wrap(base, specs, pin=False)
        h = xxhash.xxh3_64(f"fate_lab packed {FORMAT};".encode())
        for m, layer_specs in enumerate(self.specs):
            h.update(f"{m}:{sorted(repr(s) for s in layer_specs if s is not None)};".encode())
            h.update(np.asarray(base.digests[m], dtype=np.uint64).tobytes())
        path = Path(folder if folder is not None else packed_dir()) / f"experts-{h.hexdigest()}.bin"
        self.file = PackedFile.open(path)
        if self.file is None:
            write_packed(path, self._packed_items(progress))
            self.file = PackedFile.open(path)
        if self.file is None:
            raise OSError(f"the packed file {path} just written cannot be opened again")

    def fetch_at(self, m: int, e: int, spec: QuantSpec | None):
        """Full precision from the checkpoint, or the packed copy at spec read from the packed file."""
        if spec is None:
            return self.base.fetch(m, e)
        if (m, e, spec) not in self.file.runs:
            raise ValueError(f"no packed copy of expert {e} of MoE layer {m} at {spec}; this store keeps "
                             f"{self.specs[m]} for that layer")
        return self.file.read(m, e, spec)

    def read_into(self, m: int, e: int, spec: QuantSpec | None, regions: dict) -> bool:
        """Straight into a slot's bytes: full precision by the checkpoint's byte plan, packed from the packed file."""
        if spec is None:
            return self.base.read_into(m, e, None, regions)
        return (m, e, spec) in self.file.runs and self.file.read_into(m, e, spec, regions)

    def nbytes_at(self, m: int, e: int, spec: QuantSpec) -> int:
        """Bytes of the packed copy, from the index (no read)."""
        return self.file.nbytes(m, e, spec)

    def describe(self) -> str:
        """The checkpoint's tier plus the packed file."""
        return f"{super().describe()} (read from {self.file.path})"
