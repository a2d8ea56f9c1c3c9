"""A roofline from data-sheet specs to a `ComputeProfile`: what each piece of a forward costs on a device.

What this file is: `ModelCosts` (the bytes and FLOPs of one decoder layer's dense part, one routed expert, the
LM head, the KV cache a decode token reads, the router a host predictor multiplies, and the kernel launches of
each), and `derive_compute(costs, device, host)`, which turns them into the simulator's `ComputeProfile`:

    a piece that reads B bytes and does F FLOPs per token, in L kernel launches, takes
        L x launch_s + max(B / (bandwidth x bw_eff), F / (fp16 rate x compute_eff))    for one token,
    and F / (rate x eff) more for each further token of a prefill step (its weights are read once).

The host-side cross-layer prediction is a [1, H] x [H, E] GEMV + a sort on the host CPU. Every constant here is
an estimate and is named; a result that beats the bound the specs set is a bug.
What it is not: a model shape (`fate_lab/core/costs.py` reads one into `ModelCosts`) or a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.devices import DeviceSpec
from fate_lab.hardware.engines import FATE_LAB_CALL_S, FATE_LAB_PREDICT_S, host_time
from fate_lab.hardware.hosts import HostProfile

DENSE_LAUNCHES = 20  # kernels of one decoder layer's dense part in eager PyTorch (norms, q/k/v/o, rope, softmax,
# shared expert, residuals): ~20 in the Qwen1.5-MoE estimate (compute.py)
EXPERT_LAUNCHES = 4  # gate_up GEMM, activation, down GEMM, weighted add
CALL_S = FATE_LAB_CALL_S  # the experts call's own host time in fate_lab's runtime (routing ids to the host, the
# cache's step): measured, 78 us on the test machine's CPU (engines.py; scaled by the host's clock, host_time); it was
# a 10 us guess until measured
HOST_CALL_S = FATE_LAB_PREDICT_S  # a host-side prediction's fixed cost (Python + the sort of E scores): measured, 22 us


@dataclass(frozen=True)
class ModelCosts:
    """Bytes and FLOPs of the pieces of one forward (one token unless said), at the precision that runs."""

    dense_layer_bytes: float  # one decoder layer's non-routed weights: attention, norms, router, shared experts
    dense_layer_flops: float  # ... their FLOPs per token (2 per weight)
    expert_bytes: float  # one routed expert's weights
    expert_flops: float  # ... its FLOPs per token
    head_bytes: float = 0.0  # the LM head, read once per forward (spread over the layers here)
    kv_layer_bytes: float = 0.0  # KV cache one decode token reads in one layer (grows with the context)
    router_host_bytes: float = 0.0  # the next layer's router weight in fp32 on the host ([E, H] x 4)
    num_layers: int = 1  # decoder layers the head is spread over


def derive_compute(costs: ModelCosts, dev: DeviceSpec, host: HostProfile | None = None,
                   name: str = "") -> ComputeProfile:
    """The `ComputeProfile` of a model's costs on a device (and a host CPU for the prediction), by the roofline
    of the module docstring."""
    head = costs.head_bytes / max(1, costs.num_layers)
    dense_bytes = costs.dense_layer_bytes + head + costs.kv_layer_bytes
    dense_s = DENSE_LAUNCHES * dev.launch_s + max(dev.read_s(dense_bytes), dev.compute_s(costs.dense_layer_flops))
    expert_s = EXPERT_LAUNCHES * dev.launch_s + max(dev.read_s(costs.expert_bytes), dev.compute_s(costs.expert_flops))
    predict_s = predict_per_token_s = 0.0
    ghz = None if host is None else host.ghz
    if host is not None and costs.router_host_bytes:
        predict_s = host_time(HOST_CALL_S, ghz) + costs.router_host_bytes / host.bandwidth
        predict_per_token_s = costs.router_host_bytes / 2 / host.flops  # 2 FLOPs per fp32 weight (4 bytes)
    return ComputeProfile(
        name or f"roofline on {dev.name}", dense_s, dev.compute_s(costs.dense_layer_flops), expert_s,
        dev.compute_s(costs.expert_flops), host_time(CALL_S, ghz), predict_s, predict_per_token_s,
        source=f"roofline: {dev.describe()}, bandwidth x {dev.bw_efficiency}, compute x {dev.compute_efficiency}, "
               f"{dev.launch_s * 1e6:g} us a launch" + (f"; prediction on {host.name}" if host is not None else ""))
