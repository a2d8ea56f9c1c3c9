"""Bytes of a device expert slot: what one slot must hold, per precision, for the plan every driver makes.

What this file is: pure arithmetic -- the byte layout of a packed slot (`layout_bytes`: codes + fp16 scale
and zero per segment, 8-byte aligned), the slot sizing of a precision policy (`slot_sizing`: which precisions
a slot may hold, its bytes, the dequantize scratch), and the resident INT2 stand-in pool (`standin_pool_bytes`).
What it is not: the slots themselves (`fate_lab/offloading/slots.py` allocates and fills them).
"""
from __future__ import annotations

import math

import torch

from fate_lab.quant import QuantPolicy, QuantSpec, expert_nbytes, packed_nbytes

ALIGN = 8  # bytes; every segment of a packed slot starts at a multiple (fp16/fp32/bf16 views stay aligned)
SCRATCH_SLOTS = 1  # full-precision experts a packed-slot (quantized) runtime dequantizes into
STANDIN_SPEC = QuantSpec(2, 32)  # lossy="standin": the resident copy of every expert (HOBBIT's low precision)


def aligned(n: int) -> int:
    """n rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def layout_bytes(gate_up_shape, down_shape, spec: QuantSpec | None, dtype: torch.dtype) -> int:
    """Bytes one packed slot needs to hold an expert at spec (None: full precision in dtype), segments aligned."""
    total = 0
    for shape in (gate_up_shape, down_shape):
        numel = math.prod(shape)
        if spec is None:
            total += aligned(numel * dtype.itemsize)
        else:
            total += aligned(packed_nbytes(numel, spec.bits)) + 2 * aligned(numel // spec.group_size * 2)
    return total


def standin_pool_bytes(num_moe_layers: int, num_experts: int, gate_up_shape: tuple[int, int],
                       down_shape: tuple[int, int]) -> int:
    """Device bytes of a resident INT2 copy of every routed expert (lossy="standin"), packed + scales + zeros."""
    return num_moe_layers * num_experts * expert_nbytes({"gate_up": gate_up_shape, "down": down_shape}, STANDIN_SPEC)


def slot_sizing(quant: QuantPolicy | None, num_moe_layers: int, gate_up_shape: tuple[int, int],
                down_shape: tuple[int, int], dtype: torch.dtype, fp_bytes: int) -> tuple[tuple, int, int]:
    """(precisions a slot may hold, bytes of one device slot, bytes of the dequantize scratch) for a
    `QuantPolicy` (None: full-precision slots, no scratch)."""
    if quant is None:
        return (None,), fp_bytes, 0
    specs = tuple(dict.fromkeys(s for m in range(num_moe_layers) for s in quant.host_specs(m)))
    slot_bytes = max(layout_bytes(gate_up_shape, down_shape, s, dtype) for s in specs)
    return specs, slot_bytes, SCRATCH_SLOTS * fp_bytes
