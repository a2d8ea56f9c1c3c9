"""Device expert slots: where offloaded experts live on the device, full precision or packed.

What this file is: one interface, `DeviceSlots` (`write` a host expert into a slot, `weights` of a
slot for the compute, `tensors` for the memory accounting), and its two variants, for every experts
layout (one expert's tensors named and shaped as `ModelShape.expert_shapes()` gives them: gate_up
[R, H], down [H, I], and gate_up_bias [R], down_bias [H] where the family has biases):
- `FullSlots`: one tensor [S, *shape] per expert tensor, in the model's dtype; a packed (quantized)
  host copy written into one is dequantized on the device on the way in;
- `PackedSlots`: one uint8 pool `[S, slot_bytes]` that keeps experts in their packed form
  (codes + fp16 scales/zeros of the two projections, the biases at full precision beside them, a
  per-precision byte layout, segments 8-byte aligned); `weights` dequantizes a slot into a
  full-precision scratch right before the expert computes.
`SlotWriter` pairs a host store with a `DeviceSlots` (what a transfer engine calls).
What it is not: it decides nothing (which expert goes where is `cache.py`) and moves nothing
on its own schedule (the engines in `transfer.py` call `write`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from fate_lab.core.sizing import aligned, layout_bytes, segment_bytes
from fate_lab.model.experts import ExpertWeights
from fate_lab.offloading.store import HostStore
from fate_lab.quant import PackedExpert, QuantizedTensor, QuantSpec


class DeviceSlots:
    """Interface of the device slots (see the module docstring)."""

    def write(self, slot: int, src: ExpertWeights | PackedExpert, spec: QuantSpec | None,
              non_blocking: bool) -> None:  # pragma: no cover - interface
        """Copy a host expert (full precision for spec None, else packed at spec) into slot."""
        raise NotImplementedError

    def weights(self, slot: int, scratch: int = 0) -> ExpertWeights:  # pragma: no cover
        """The expert in slot at full precision (canonical ExpertWeights), for the compute."""
        raise NotImplementedError

    def regions(self, slot: int, spec: QuantSpec | None) -> dict[str, tuple[np.ndarray, torch.dtype]] | None:
        """The bytes an expert at spec occupies in slot, by tensor name (a uint8 view and the tensor's dtype), for a
        store that reads straight into them (`HostStore.read_into`); None where the slots are not in host memory."""
        return None

    def filled(self, slot: int, spec: QuantSpec | None) -> None:
        """An expert at spec was read straight into slot's `regions`."""

    def tensors(self) -> list[torch.Tensor]:  # pragma: no cover - interface
        """The device tensors these slots allocated."""
        raise NotImplementedError

    def fp_nbytes(self) -> int:  # pragma: no cover - interface
        """Bytes of one expert at full precision, biases included (what a transfer with spec None moves)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Device bytes of every tensor these slots hold."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        """The device the slots live on."""
        return self.tensors()[0].device


class FullSlots(DeviceSlots):
    """Full-precision slots: one tensor [S, *shape] per expert tensor (gate_up [S, R, H], down [S, H, I], ...)."""

    def __init__(self, slots: Mapping[str, torch.Tensor]):
        self.slots = dict(slots)  # name -> (S, *shape)
        n = next(iter(self.slots.values())).shape[0]
        self._views: list[ExpertWeights | None] = [None] * n  # slot -> its views, made once (writes copy into them)
        self._regions: list[dict | None] = [None] * n

    @classmethod
    def empty(cls, n_slots: int, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
              device: torch.device | str) -> FullSlots:
        """Allocate n_slots slots once, one tensor per entry of shapes (`ModelShape.expert_shapes()`)."""
        return cls({n: _touched(n_slots, *shape, dtype=dtype, device=device) for n, shape in shapes.items()})

    @property
    def gate_up(self) -> torch.Tensor:
        """The up (or gate-and-up) projections of every slot [S, R, H]."""
        return self.slots["gate_up"]

    @property
    def down(self) -> torch.Tensor:
        """The down projections of every slot [S, H, I]."""
        return self.slots["down"]

    def write(self, slot: int, src: ExpertWeights | PackedExpert, spec: QuantSpec | None, non_blocking: bool) -> None:
        """Copy a full-precision expert into slot; a packed one travels packed and is dequantized there."""
        if isinstance(src, PackedExpert):
            dev = src.to(self.gate_up.device, non_blocking=non_blocking)  # only packed bytes travel
            dev.gate_up.dequantize(out=self.gate_up[slot])  # (R, H) on the device
            dev.down.dequantize(out=self.down[slot])  # (H, I)
            for name, b in dev.biases().items():
                self.slots[name][slot].copy_(b)
            return
        for name, t in src.tensors().items():
            self.slots[name][slot].copy_(t, non_blocking=non_blocking)  # (R, H), (H, I), biases

    def regions(self, slot: int, spec: QuantSpec | None) -> dict[str, tuple[np.ndarray, torch.dtype]] | None:
        """Each slot tensor's bytes (made once per slot), for a full-precision expert on a CPU device."""
        if spec is not None or self.gate_up.device.type != "cpu":
            return None
        r = self._regions[slot]
        if r is None:
            r = self._regions[slot] = {n: (t[slot].reshape(-1).view(torch.uint8).numpy(), t.dtype)
                                       for n, t in self.slots.items()}
        return r

    def weights(self, slot: int, scratch: int = 0) -> ExpertWeights:
        """The slot's tensors, used in place (views made on first use and kept: `write` copies into them)."""
        v = self._views[slot]
        if v is None:
            v = self._views[slot] = ExpertWeights(**{n: t[slot] for n, t in self.slots.items()})
        return v

    def tensors(self) -> list[torch.Tensor]:
        """One tensor per expert tensor name."""
        return list(self.slots.values())

    def fp_nbytes(self) -> int:
        """Bytes of one slot."""
        return sum(t[0].numel() * t.element_size() for t in self.slots.values())


def _touched(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Slot memory with every page touched now, at offload: host memory that is allocated but not yet written is
    mapped by the kernel at its first write, and on a CPU device that first write was the first forward's loads (a
    page fault per 4 KiB: about 35 ms per 100 MB on this machine, paid by a cold run's first token)."""
    return torch.zeros(*shape, dtype=dtype, device=device)


_SHIFTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _dequantize_into(q: QuantizedTensor, out: torch.Tensor) -> torch.Tensor:
    """`q.dequantize(out=out)`, bit for bit, about twice as fast for 2/4/8 bits (no code crosses a byte:
    code j of byte k is (byte >> bits*j) & mask, the order `quant.pack` writes), fp32 math as there."""
    bits, g = q.spec.bits, q.spec.group_size
    if bits not in (2, 4, 8):
        return q.dequantize(out=out)
    p = q.packed
    if bits == 8:
        codes = p
    else:
        key = (bits, p.device)
        if key not in _SHIFTS:
            _SHIFTS[key] = torch.arange(0, 8, bits, dtype=torch.uint8, device=p.device)
        codes = (p.unsqueeze(-1) >> _SHIFTS[key]) & ((1 << bits) - 1)  # (bytes, 8 / bits) uint8
    codes = codes.reshape(-1, g)  # (G, g)
    scale, zero = q.scale.reshape(-1, 1).float(), q.zero.reshape(-1, 1).float()  # (G, 1)
    if out.dtype == torch.float32 and out.is_contiguous():
        w = out.view(-1, g)
        torch.mul(codes, scale, out=w)
        return w.add_(zero).view(out.shape)
    return out.copy_((codes * scale + zero).view(out.shape))


def dequantize_s(packed, reps: int = 30) -> float:
    """Median seconds of what every compute from a packed slot pays first (`PackedSlots.weights`): both projections
    of one packed expert (`quant.PackedExpert`) dequantized into full-precision scratch tensors, on this thread."""
    import time

    outs = [torch.empty(q.shape, dtype=torch.float32, device=q.packed.device) for q in (packed.gate_up, packed.down)]
    times = []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        _dequantize_into(packed.gate_up, outs[0])
        _dequantize_into(packed.down, outs[1])
        if outs[0].device.type == "cuda":
            torch.cuda.synchronize(outs[0].device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[3:])  # the first calls allocate
    return times[len(times) // 2]


class PackedSlots(DeviceSlots):
    """Device slots that hold experts in their packed form: one uint8 pool [S, slot_bytes].

    A slot holds one expert at any precision in `specs` (None: full precision in `dtype`), laid out
    tensor after tensor in the order of `shapes` -- a projection as codes, fp16 scale, fp16 zero (or its
    weights at full precision), a bias always at full precision -- each segment 8-byte aligned;
    `slot_bytes` is the largest layout. `spec_of[slot]` is the precision the slot holds now (set when a
    transfer writes it). `weights(slot)` dequantizes the projections into the fp scratch
    [n_scratch, R, H] / [n_scratch, H, I] (a full-precision slot is used in place).
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], specs, dtype: torch.dtype, n_slots: int,
                 n_scratch: int, device: torch.device | str):
        self.shapes = {n: tuple(s) for n, s in shapes.items()}
        self.dtype = dtype
        self._layouts: dict[QuantSpec | None, dict] = {s: self._layout(s) for s in dict.fromkeys(specs)}
        self.slot_bytes = max(lay["bytes"] for lay in self._layouts.values())
        assert self.slot_bytes == max(layout_bytes(self.shapes, s, dtype) for s in self._layouts)
        self.pool = _touched(n_slots, self.slot_bytes, dtype=torch.uint8, device=device)  # (S, slot_bytes)
        self.gate_up_scratch = _touched(n_scratch, *self.shapes["gate_up"], dtype=dtype, device=device)  # (n, R, H)
        self.down_scratch = _touched(n_scratch, *self.shapes["down"], dtype=dtype, device=device)  # (n, H, I)
        self.spec_of: list[QuantSpec | None] = [None] * n_slots
        self._regions: dict[tuple[QuantSpec | None, int], dict] = {}
        # spec -> slot -> the slot's views at that precision, all made here: made on a slot's first use, they cost
        # about 30 us each (six slices and views of the pool), which a cold prefill paid for every slot it filled
        self._views: dict[QuantSpec | None, list[PackedExpert | ExpertWeights]] = {
            spec: [self._make_view(slot, spec) for slot in range(n_slots)] for spec in self._layouts}

    def _layout(self, spec: QuantSpec | None) -> dict:
        off, out = 0, {}
        for name, shape in self.shapes.items():
            sizes = segment_bytes(name, shape, spec, self.dtype)
            parts = ("w",) if len(sizes) == 1 else ("packed", "scale", "zero")
            segs = {}
            for part, n in zip(parts, sizes, strict=False):
                segs[part] = (off, n)
                off += aligned(n)
            out[name] = segs
        out["bytes"] = off
        return out

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors: pool, gate_up scratch, down scratch."""
        return [self.pool, self.gate_up_scratch, self.down_scratch]

    def _seg(self, slot: int, seg: tuple[int, int]) -> torch.Tensor:
        off, n = seg
        return self.pool[slot, off:off + n]  # (n,) uint8

    def view(self, slot: int) -> PackedExpert | ExpertWeights:
        """The slot's contents as device tensors (views of the pool), at the precision it holds (made at
        construction for every precision in `specs`)."""
        return self._views[self.spec_of[slot]][slot]

    def _make_view(self, slot: int, spec: QuantSpec | None) -> PackedExpert | ExpertWeights:
        lay = self._layouts[spec]
        parts = {}
        for name, shape in self.shapes.items():
            if "w" in lay[name]:
                parts[name] = self._seg(slot, lay[name]["w"]).view(self.dtype).view(shape)
                continue
            grouped = (*shape[:-1], shape[-1] // spec.group_size)
            parts[name] = QuantizedTensor(
                self._seg(slot, lay[name]["packed"]),
                self._seg(slot, lay[name]["scale"]).view(torch.float16).view(grouped),
                self._seg(slot, lay[name]["zero"]).view(torch.float16).view(grouped), shape, spec)
        return (ExpertWeights if spec is None else PackedExpert)(**parts)

    def regions(self, slot: int, spec: QuantSpec | None) -> dict[str, tuple[np.ndarray, torch.dtype]] | None:
        """The slot's segments at spec, named as `packed_file` names an expert's tensors ("gate_up.packed",
        "gate_up.scale", ..., "gate_up_bias"; at full precision the canonical names), on a CPU device."""
        if spec not in self._layouts or self.pool.device.type != "cpu":
            return None
        key = (spec, slot)
        r = self._regions.get(key)
        if r is None:
            r = {}
            for name, segs in self._layouts[spec].items():
                if name == "bytes":
                    continue
                for part, seg in segs.items():
                    dtype = self.dtype if part == "w" else torch.uint8 if part == "packed" else torch.float16
                    r[name if part == "w" else f"{name}.{part}"] = (self._seg(slot, seg).numpy(), dtype)
            self._regions[key] = r
        return r

    def filled(self, slot: int, spec: QuantSpec | None) -> None:
        """The slot now holds an expert at spec."""
        self.spec_of[slot] = spec

    def write(self, slot: int, src: PackedExpert | ExpertWeights, spec: QuantSpec | None, non_blocking: bool) -> None:
        """Copy a host expert's bytes (packed, or full precision for spec None) into slot, as they are."""
        if spec not in self._layouts:
            raise ValueError(f"these packed slots hold {list(self._layouts)}, not {spec}")
        lay = self._layouts[spec]
        for name in self.shapes:
            t = getattr(src, name)
            if "w" in lay[name]:
                self._seg(slot, lay[name]["w"]).view(self.dtype).copy_(t.reshape(-1), non_blocking=non_blocking)
                continue
            self._seg(slot, lay[name]["packed"]).copy_(t.packed.reshape(-1), non_blocking=non_blocking)
            for part in ("scale", "zero"):
                self._seg(slot, lay[name][part]).view(torch.float16).copy_(
                    getattr(t, part).reshape(-1), non_blocking=non_blocking)
        self.spec_of[slot] = spec

    def weights(self, slot: int, scratch: int = 0) -> ExpertWeights:
        """The expert in slot at full precision (projections dequantized into the scratch), for the compute."""
        v = self.view(slot)
        if isinstance(v, ExpertWeights):
            return v
        gu, dn = self.gate_up_scratch[scratch], self.down_scratch[scratch]
        _dequantize_into(v.gate_up, gu)  # (R, H) dequantized on the device
        _dequantize_into(v.down, dn)  # (H, I)
        return ExpertWeights(gu, dn, **v.biases())

    def fp_nbytes(self) -> int:
        """Bytes of one expert at full precision, biases included."""
        return sum(math.prod(s) for s in self.shapes.values()) * self.dtype.itemsize


class SlotWriter:
    """Copies a host expert from a store into device slots (shared by every engine and the sync load)."""

    def __init__(self, store: HostStore, slots: DeviceSlots, direct: bool = False):
        """direct: read straight into a slot's bytes where the store can (`OffloadConfig(direct_reads=True)`)."""
        self.store, self.slots, self.direct = store, slots, direct
        self._fp_nbytes = slots.fp_nbytes()  # a slot's size never changes; asked at every submit (1.9 us to sum)

    def write(self, m: int, e: int, slot: int, spec: QuantSpec | None, non_blocking: bool) -> None:
        """Move (m, e) at spec into slot: with `direct`, straight into the slot's bytes where the store can read it so
        (the disk link, slots in host memory: `HostStore.read_into`); else as host tensors copied in."""
        regions = self.slots.regions(slot, spec) if self.direct else None
        if regions is not None and self.store.read_into(m, e, spec, regions):
            self.slots.filled(slot, spec)
            return
        self.slots.write(slot, self.store.fetch_at(m, e, spec), spec, non_blocking)

    def nbytes(self, m: int, e: int, spec: QuantSpec | None) -> int:
        """Bytes a transfer of (m, e) at spec moves: full precision, or the packed size."""
        return self._fp_nbytes if spec is None else self.store.nbytes_at(m, e, spec)
