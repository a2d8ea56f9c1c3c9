"""Bytes of a device expert slot: what one slot must hold, per precision, for the plan every driver makes.

What this file is: pure arithmetic -- the byte layout of a packed slot (`layout_bytes`: codes + fp16 scale
and zero per packed segment, biases at full precision, every segment 8-byte aligned), the slot sizing of a
precision policy (`slot_sizing`: which precisions a slot may hold, its bytes, the dequantize scratch), and the
resident INT2 stand-in pool (`standin_pool_bytes`). One expert's tensors are named as
`ModelShape.expert_shapes()` names them: gate_up (R, H), down (H, I), and gate_up_bias (R,), down_bias (H,)
for the families whose experts have biases (they are never quantized).
What it is not: the slots themselves (`fate_lab/offloading/slots.py` allocates and fills them).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fate_lab.quant import QuantPolicy, QuantSpec, expert_nbytes, packed_nbytes

ALIGN = 8  # bytes; every segment of a packed slot starts at a multiple (fp16/fp32/bf16 views stay aligned)
SCRATCH_SLOTS = 1  # full-precision experts a packed-slot (quantized) runtime dequantizes into
STANDIN_SPEC = QuantSpec(2, 32)  # lossy="standin": the resident copy of every expert (HOBBIT's low precision)


def aligned(n: int) -> int:
    """n rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def is_bias(name: str) -> bool:
    """True for an expert tensor that stays at full precision at every spec (a bias)."""
    return name.endswith("_bias")


def segment_bytes(name: str, shape: tuple[int, ...], spec: QuantSpec | None, dtype: torch.dtype) -> list[int]:
    """Unaligned byte sizes of the segments one expert tensor takes in a packed slot: [weights] at full
    precision (a bias, or spec None), else [codes, fp16 scales, fp16 zeros]."""
    numel = math.prod(shape)
    if spec is None or is_bias(name):
        return [numel * dtype.itemsize]
    return [packed_nbytes(numel, spec.bits), numel // spec.group_size * 2, numel // spec.group_size * 2]


def layout_bytes(shapes: Mapping[str, tuple[int, ...]], spec: QuantSpec | None, dtype: torch.dtype) -> int:
    """Bytes one packed slot needs to hold an expert at spec (None: full precision in dtype), segments aligned."""
    return sum(aligned(n) for name, shape in shapes.items() for n in segment_bytes(name, shape, spec, dtype))


def standin_pool_bytes(num_moe_layers: int, num_experts: int, gate_up_shape: tuple[int, int],
                       down_shape: tuple[int, int], bias_shapes: Mapping[str, tuple[int, ...]] | None = None,
                       dtype: torch.dtype = torch.float16) -> int:
    """Device bytes of a resident INT2 copy of every routed expert (lossy="standin"), packed + scales + zeros,
    plus each expert's biases (bias_shapes, e.g. {"gate_up_bias": (R,), "down_bias": (H,)}) at dtype."""
    shapes = {"gate_up": gate_up_shape, "down": down_shape, **(bias_shapes or {})}
    return num_moe_layers * num_experts * expert_nbytes(shapes, STANDIN_SPEC, dtype=dtype)


def slot_sizing(quant: QuantPolicy | None, num_moe_layers: int, shapes: Mapping[str, tuple[int, ...]],
                dtype: torch.dtype, fp_bytes: int) -> tuple[tuple, int, int]:
    """(precisions a slot may hold, bytes of one device slot, bytes of the dequantize scratch) for a
    `QuantPolicy` (None: full-precision slots, no scratch); shapes: one expert's tensors."""
    if quant is None:
        return (None,), fp_bytes, 0
    specs = tuple(dict.fromkeys(s for m in range(num_moe_layers) for s in quant.host_specs(m)))
    slot_bytes = max(layout_bytes(shapes, s, dtype) for s in specs)
    return specs, slot_bytes, SCRATCH_SLOTS * fp_bytes
