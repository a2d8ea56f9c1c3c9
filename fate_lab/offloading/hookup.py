"""The HF hook-up: how an offloaded runtime plugs into a transformers MoE model and unplugs again.

What this file is: the experts implementation registered as "fate_offload" in transformers'
`ExpertsInterface` (it forwards each experts call to the runtime attached to the module), the
checks that a model's experts module is one the runtime can serve, emptying the fused expert
tensors on the device and putting them back on close, and `StepwiseForward` (a model run one
token at a time, so every position is a decode step of the offloaded model).
What it is not: no slot, cache or transfer logic (`cache.py`, `slots.py`, `transfer.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from fate_lab.model.adapters import OFFLOAD_MARK, MoEAdapter
from fate_lab.offloading.store import HostStore

IMPLEMENTATION = "fate_offload"


def _fate_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """Experts implementation registered as "fate_offload": defers to the runtime attached to the module."""
    block = getattr(self, OFFLOAD_MARK, None)
    if block is None:
        raise RuntimeError(
            "experts_implementation='fate_offload' is set but this experts module is not offloaded; "
            "call fate_lab.offload(model, config), or model.set_experts_implementation('eager')"
        )
    return block.runtime.layer_forward(block.m, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, _fate_experts_forward)


@dataclass(eq=False)
class OffloadedExperts:
    """What the runtime attaches to one HF experts module: its MoE layer index and the runtime."""

    m: int
    runtime: object


def check_experts_module(mod: nn.Module) -> None:
    """Refuse an experts module whose layout the offloaded kernel does not implement."""
    for flag, want in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                       ("has_gate", True), ("has_post_expert_norm", False)):
        if getattr(mod, flag, want) != want:
            raise NotImplementedError(f"{type(mod).__name__}.{flag}={not want} is not supported by the runtime")


def attach(adapter: MoEAdapter, runtime: object) -> str:
    """Attach runtime to every experts module and switch the model to "fate_offload"; returns the previous
    implementation name (for `detach`)."""
    model = adapter.model
    prev = model.config._experts_implementation
    for m in range(adapter.num_moe_layers):
        setattr(adapter.experts_module(m), OFFLOAD_MARK, OffloadedExperts(m, runtime))
    model.set_experts_implementation(IMPLEMENTATION)
    return prev


def detach(adapter: MoEAdapter, prev_impl: str | None) -> None:
    """Undo `attach`: the experts modules forget the runtime and the previous implementation returns."""
    for m in range(adapter.num_moe_layers):
        mod = adapter.experts_module(m)
        if hasattr(mod, OFFLOAD_MARK):
            delattr(mod, OFFLOAD_MARK)
    if prev_impl is not None:
        adapter.model.set_experts_implementation(prev_impl)


def free_fused_experts(adapter: MoEAdapter, dtype: torch.dtype, device: torch.device) -> list[tuple]:
    """Replace the fused expert tensors by empty ones: the device keeps no routed expert.

    Returns the (gate_up, down) Parameters it took, per MoE layer: on a CPU "device" the caller keeps
    them (they are host memory already, so keeping them costs nothing) and puts them back on close.
    """
    taken = []
    for m in range(adapter.num_moe_layers):
        mod = adapter.experts_module(m)
        taken.append((mod.gate_up_proj, mod.down_proj))
        for name in ("gate_up_proj", "down_proj"):
            setattr(mod, name, nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return taken


def put_back(adapter: MoEAdapter, taken: list[tuple]) -> None:
    """Give the experts modules exactly the Parameters `free_fused_experts` took."""
    for m, (gate_up, down) in enumerate(taken):
        mod = adapter.experts_module(m)
        mod.gate_up_proj, mod.down_proj = gate_up, down


def restore_fused_experts(adapter: MoEAdapter, store: HostStore, device: torch.device) -> None:
    """Put every layer's fused expert tensors back on the device from the host store (a device that is
    not the host: the tensors the runtime took were freed there)."""
    for m in range(adapter.num_moe_layers):
        mod = adapter.experts_module(m)
        gate_up, down = store.layer(m)  # (E, 2I, H), (E, H, I)
        mod.gate_up_proj = nn.Parameter(gate_up.to(device), requires_grad=False)
        mod.down_proj = nn.Parameter(down.to(device), requires_grad=False)


class StepwiseForward(nn.Module):
    """`model(input_ids=[B, T])` run one token at a time with the KV cache, so every position is a
    decode step of an offloaded model (prefetch, cache and on-demand precisions as in generation);
    for teacher-forced quality of the decode-time mix with `quant.quality_report`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, **_) -> "StepwiseOutput":
        """Logits [B, T, V] of input_ids [B, T], computed as T decode steps."""
        cache, steps = None, []
        for t in range(input_ids.shape[1]):
            out = self.model(input_ids=input_ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = out["cache"]
            steps.append(out.logits)  # (B, 1, V)
        return StepwiseOutput(torch.cat(steps, dim=1))  # (B, T, V)


@dataclass
class StepwiseOutput:
    """What `StepwiseForward` returns: the logits, like a transformers output."""

    logits: torch.Tensor  # (B, T, V)
