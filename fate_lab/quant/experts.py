"""One routed expert quantized: `PackedExpert` and `pack_expert`, on the canonical layout of `model.experts`.

What this file is: an expert's up (or gate-and-up) projection [R, H] and down projection [H, I] quantized
groupwise along their last (input) dim, whatever the layout its experts module stores (transposed or not:
`ExpertWeights` is always canonical), with its biases kept at full precision beside them -- they are a
few hundred values and travel with their expert. `PackedExpert.dequantize` gives the `ExpertWeights`
that `model.experts.expert_apply` computes with.
What it is not: the packing format (`kernels.py`) or where the bytes live (`offloading/store.py`, `slots.py`).
Letters: R rows of the up projection (2I with a gate, I without), H hidden, I expert intermediate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fate_lab.model.experts import ExpertWeights
from fate_lab.quant.kernels import QuantizedTensor, QuantSpec, quantize

BIASES = ("gate_up_bias", "down_bias")


@dataclass(frozen=True)
class PackedExpert:
    """One expert quantized: packed codes + fp16 scale/zero of its projections, its biases at full precision."""

    gate_up: QuantizedTensor  # (R, H) groups along H
    down: QuantizedTensor  # (H, I) groups along I
    gate_up_bias: torch.Tensor | None = None  # (R,) full precision
    down_bias: torch.Tensor | None = None  # (H,) full precision

    def biases(self) -> dict[str, torch.Tensor]:
        """The bias tensors that exist, by field name."""
        return {n: getattr(self, n) for n in BIASES if getattr(self, n) is not None}

    @property
    def nbytes(self) -> int:
        """Bytes that travel: packed codes, scales and zeros of both projections, plus the biases."""
        return self.gate_up.nbytes() + self.down.nbytes() + sum(b.numel() * b.element_size()
                                                                for b in self.biases().values())

    @property
    def spec(self) -> QuantSpec:
        """The precision both projections are at."""
        return self.gate_up.spec

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedExpert:
        """A copy on device: the packed bytes move, not dequantized weights."""
        return PackedExpert(self.gate_up.to(device, non_blocking), self.down.to(device, non_blocking),
                            **{n: b.to(device, non_blocking=non_blocking) for n, b in self.biases().items()})

    def pin_memory(self) -> PackedExpert:
        """A copy in page-locked host memory."""
        return PackedExpert(self.gate_up.pin_memory(), self.down.pin_memory(),
                            **{n: b.pin_memory() for n, b in self.biases().items()})

    def dequantize(self, dtype: torch.dtype) -> ExpertWeights:
        """The full-precision ExpertWeights in dtype (biases as they are)."""
        return ExpertWeights(self.gate_up.dequantize(dtype), self.down.dequantize(dtype), **self.biases())


def pack_expert(w: ExpertWeights, spec: QuantSpec, name: str = "expert") -> PackedExpert:
    """Quantize one expert's projections at spec (groups along H for the up projection, along I for down);
    its biases stay as they are. ValueError naming the tensor for weights the format cannot hold."""
    return PackedExpert(quantize(w.gate_up, spec, name=f"{name} gate_up"), quantize(w.down, spec, name=f"{name} down"),
                        w.gate_up_bias, w.down_bias)
