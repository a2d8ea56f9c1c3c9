"""Device expert slots: where offloaded experts live on the device, full precision or packed.

What this file is: one interface, `DeviceSlots` (`write` a host expert into a slot, `weights`
of a slot for the compute, `tensors` for the memory accounting), and its two variants:
- `FullSlots`: two fused tensors `[S, 2I, H]` and `[S, H, I]` in the model's dtype; a packed
  (quantized) host copy written into one is dequantized on the device on the way in;
- `PackedSlots`: one uint8 pool `[S, slot_bytes]` that keeps experts in their packed form
  (codes + fp16 scales/zeros, a per-precision byte layout, segments 8-byte aligned); `weights`
  dequantizes a slot into a full-precision scratch right before the expert computes.
`SlotWriter` pairs a host store with a `DeviceSlots` (what a transfer engine calls).
What it is not: it decides nothing (which expert goes where is `cache.py`) and moves nothing
on its own schedule (the engines in `transfer.py` call `write`).
"""
from __future__ import annotations

import math

import torch

from fate_lab.offloading.store import ExpertTensors, HostStore, PackedExpert
from fate_lab.core.sizing import aligned, layout_bytes
from fate_lab.quant import QuantSpec, QuantizedTensor, packed_nbytes


class DeviceSlots:
    """Interface of the device slots (see the module docstring)."""

    def write(self, slot: int, src: ExpertTensors | PackedExpert, spec: QuantSpec | None,
              non_blocking: bool) -> None:  # pragma: no cover - interface
        """Copy a host expert (full precision for spec None, else packed at spec) into slot."""
        raise NotImplementedError

    def weights(self, slot: int, scratch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        """(gate_up [2I, H], down [H, I]) of the expert in slot at full precision, for the compute."""
        raise NotImplementedError

    def tensors(self) -> list[torch.Tensor]:  # pragma: no cover - interface
        """The device tensors these slots allocated."""
        raise NotImplementedError

    def fp_nbytes(self) -> int:  # pragma: no cover - interface
        """Bytes of one expert at full precision (what a transfer with spec None moves)."""
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
    """Full-precision slots: gate_up [S, 2I, H] and down [S, H, I] in the model's dtype."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        self.gate_up, self.down = gate_up, down  # (S, 2I, H), (S, H, I)

    @classmethod
    def empty(cls, n_slots: int, gate_up_shape: tuple[int, int], down_shape: tuple[int, int], dtype: torch.dtype,
              device: torch.device | str) -> "FullSlots":
        """Allocate n_slots slots once."""
        return cls(torch.empty(n_slots, *gate_up_shape, dtype=dtype, device=device),
                   torch.empty(n_slots, *down_shape, dtype=dtype, device=device))

    def write(self, slot: int, src: ExpertTensors | PackedExpert, spec: QuantSpec | None, non_blocking: bool) -> None:
        """Copy a full-precision expert into slot; a packed one travels packed and is dequantized there."""
        if isinstance(src, PackedExpert):
            dev = src.to(self.gate_up.device, non_blocking=non_blocking)  # only packed bytes travel
            dev.gate_up.dequantize(out=self.gate_up[slot])  # (2I, H) on the device
            dev.down.dequantize(out=self.down[slot])  # (H, I)
            return
        self.gate_up[slot].copy_(src.gate_up, non_blocking=non_blocking)  # (2I, H)
        self.down[slot].copy_(src.down, non_blocking=non_blocking)  # (H, I)

    def weights(self, slot: int, scratch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's tensors, used in place."""
        return self.gate_up[slot], self.down[slot]

    def tensors(self) -> list[torch.Tensor]:
        """[gate_up, down]."""
        return [self.gate_up, self.down]

    def fp_nbytes(self) -> int:
        """Bytes of one slot."""
        return self.gate_up[0].numel() * self.gate_up.element_size() + self.down[0].numel() * self.down.element_size()


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


class PackedSlots(DeviceSlots):
    """Device slots that hold experts in their packed form: one uint8 pool [S, slot_bytes].

    A slot holds one expert at any precision in `specs` (None: full precision in `dtype`), laid
    out as gate_up (codes, fp16 scale, fp16 zero) then down (codes, scale, zero), each segment
    8-byte aligned; `slot_bytes` is the largest layout. `spec_of[slot]` is the precision the slot
    holds now (set when a transfer writes it). `weights(slot)` dequantizes into the fp scratch
    [n_scratch, 2I, H] / [n_scratch, H, I] (a full-precision slot is used in place).
    """

    def __init__(self, gate_up_shape: tuple[int, int], down_shape: tuple[int, int], specs, dtype: torch.dtype,
                 n_slots: int, n_scratch: int, device: torch.device | str):
        self.shapes = {"gate_up": tuple(gate_up_shape), "down": tuple(down_shape)}
        self.dtype = dtype
        self._layouts: dict[QuantSpec | None, dict] = {s: self._layout(s) for s in dict.fromkeys(specs)}
        self.slot_bytes = max(lay["bytes"] for lay in self._layouts.values())
        assert self.slot_bytes == max(layout_bytes(gate_up_shape, down_shape, s, dtype) for s in self._layouts)
        self.pool = torch.empty(n_slots, self.slot_bytes, dtype=torch.uint8, device=device)  # (S, slot_bytes)
        self.gate_up_scratch = torch.empty(n_scratch, *gate_up_shape, dtype=dtype, device=device)  # (n, 2I, H)
        self.down_scratch = torch.empty(n_scratch, *down_shape, dtype=dtype, device=device)  # (n, H, I)
        self.spec_of: list[QuantSpec | None] = [None] * n_slots

    def _layout(self, spec: QuantSpec | None) -> dict:
        off, out = 0, {}
        for name, shape in self.shapes.items():
            numel = math.prod(shape)
            if spec is None:
                n = numel * self.dtype.itemsize
                out[name] = {"w": (off, n)}
                off += aligned(n)
                continue
            segs = {}
            for part, n in (("packed", packed_nbytes(numel, spec.bits)), ("scale", numel // spec.group_size * 2),
                            ("zero", numel // spec.group_size * 2)):
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

    def view(self, slot: int) -> PackedExpert | ExpertTensors:
        """The slot's contents as device tensors (views of the pool), at the precision it holds."""
        spec = self.spec_of[slot]
        lay = self._layouts[spec]
        parts = {}
        for name, shape in self.shapes.items():
            if spec is None:
                parts[name] = self._seg(slot, lay[name]["w"]).view(self.dtype).view(shape)
                continue
            grouped = (*shape[:-1], shape[-1] // spec.group_size)
            parts[name] = QuantizedTensor(
                self._seg(slot, lay[name]["packed"]),
                self._seg(slot, lay[name]["scale"]).view(torch.float16).view(grouped),
                self._seg(slot, lay[name]["zero"]).view(torch.float16).view(grouped), shape, spec)
        cls = ExpertTensors if spec is None else PackedExpert
        return cls(parts["gate_up"], parts["down"])

    def write(self, slot: int, src: PackedExpert | ExpertTensors, spec: QuantSpec | None, non_blocking: bool) -> None:
        """Copy a host expert's bytes (packed, or full precision for spec None) into slot, as they are."""
        if spec not in self._layouts:
            raise ValueError(f"these packed slots hold {list(self._layouts)}, not {spec}")
        lay = self._layouts[spec]
        for name in self.shapes:
            t = getattr(src, name)
            if spec is None:
                self._seg(slot, lay[name]["w"]).view(self.dtype).copy_(t.reshape(-1), non_blocking=non_blocking)
                continue
            self._seg(slot, lay[name]["packed"]).copy_(t.packed.reshape(-1), non_blocking=non_blocking)
            for part in ("scale", "zero"):
                self._seg(slot, lay[name][part]).view(torch.float16).copy_(
                    getattr(t, part).reshape(-1), non_blocking=non_blocking)
        self.spec_of[slot] = spec

    def weights(self, slot: int, scratch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of the expert in slot at full precision, for the compute."""
        v = self.view(slot)
        if isinstance(v, ExpertTensors):
            return v.gate_up, v.down
        gu, dn = self.gate_up_scratch[scratch], self.down_scratch[scratch]
        _dequantize_into(v.gate_up, gu)  # (2I, H) dequantized on the device
        _dequantize_into(v.down, dn)  # (H, I)
        return gu, dn


    def fp_nbytes(self) -> int:
        """Bytes of one expert at full precision (the scratch's size)."""
        return self.gate_up_scratch[0].numel() * self.gate_up_scratch.element_size() + \
            self.down_scratch[0].numel() * self.down_scratch.element_size()


class SlotWriter:
    """Copies a host expert from a store into device slots (shared by every engine and the sync load)."""

    def __init__(self, store: HostStore, slots: DeviceSlots):
        self.store, self.slots = store, slots

    def write(self, m: int, e: int, slot: int, spec: QuantSpec | None, non_blocking: bool) -> None:
        """Move (m, e) at spec into slot."""
        self.slots.write(slot, self.store.fetch_at(m, e, spec), spec, non_blocking)

    def nbytes(self, m: int, e: int, spec: QuantSpec | None) -> int:
        """Bytes a transfer of (m, e) at spec moves: full precision, or the packed size."""
        return self.slots.fp_nbytes() if spec is None else self.store.nbytes_at(m, e, spec)
