"""What one forward of a model costs, in bytes and FLOPs, read off its shape: the roofline's input.

What this file is: `model_costs(shape, vocab_size, tied, context)` -> `hardware.roofline.ModelCosts`: one routed
expert (its bytes, 2 FLOPs per weight), one decoder layer's dense part (the non-expert weights, minus the
embeddings and the LM head, averaged over the decoder layers: a dense-only layer's MLP is spread over all of
them, as the simulator charges every layer the same dense time), the LM head, the KV cache a decode token reads
at a context, and the next layer's router on the host (fp32). And `compute_for`: the `ComputeProfile` of a shape
on a named device (`hardware/devices.py`), by the roofline.
What it is not: the roofline (`hardware/roofline.py`) or a measurement.
"""
from __future__ import annotations

from fate_lab.core.shape import ModelShape
from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.devices import device
from fate_lab.hardware.hosts import host_profile
from fate_lab.hardware.roofline import ModelCosts, derive_compute


def model_costs(shape: ModelShape, vocab_size: int = 0, tied: bool = False, context: int = 0) -> ModelCosts:
    """The bytes and FLOPs of one token's forward pieces (module docstring); vocab_size 0: no head or embeddings known."""
    b = shape.dtype.itemsize
    embed = vocab_size * shape.hidden * b  # the embedding table (a lookup reads one row)
    head = embed  # the LM head reads a [V, H] matrix per forward (the embedding itself when tied)
    in_layers = max(0, shape.dense_bytes - embed - (0 if tied else head))
    layer = in_layers / shape.num_layers
    expert = shape.nbytes(None)
    return ModelCosts(dense_layer_bytes=layer, dense_layer_flops=2 * layer / b, expert_bytes=expert,
                      expert_flops=2 * expert / b, head_bytes=head,
                      kv_layer_bytes=shape.kv_bytes_per_token * context / shape.num_layers,
                      router_host_bytes=4 * shape.num_experts * shape.hidden, num_layers=shape.num_layers)


def compute_for(shape: ModelShape, device_name: str, host: str = "desktop_ddr4", vocab_size: int = 0,
                tied: bool = False, context: int = 0) -> ComputeProfile:
    """The roofline `ComputeProfile` of a model shape on a named device, the prediction on a named host CPU."""
    dev = device(device_name)
    return derive_compute(model_costs(shape, vocab_size, tied, context), dev, host_profile(host),
                          f"roofline: {dev.name}")
