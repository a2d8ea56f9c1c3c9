"""The HF hook-up: how an offloaded runtime plugs into a transformers MoE model and unplugs again.

What this file is: the experts implementation registered as "fate_offload" in transformers'
`ExpertsInterface` (it forwards each experts call to the runtime attached to the module), the
check that a model's experts modules are ones the runtime can serve (`model.experts.expert_refusal`),
emptying every routed-expert tensor (weights and biases, per layout) on the device and giving the
caller back its own Parameters on close, and `StepwiseForward` (a model run one token at a time, so
every position is a decode step of the offloaded model), and `guard_forward`, which ends a forward in
the runtime on Ctrl-C too.
What it is not: no slot, cache or transfer logic (`cache.py`, `slots.py`, `transfer.py`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from fate_lab.model.adapters import OFFLOAD_MARK, MoEAdapter
from fate_lab.model.experts import expert_refusal
from fate_lab.offloading.store import HostStore

IMPLEMENTATION = "fate_offload"
NO_EXPERTS = "_fate_no_experts"  # set on the experts modules of a closed runtime that had no copy to give back


def _fate_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """Experts implementation registered as "fate_offload": defers to the runtime attached to the module."""
    block = getattr(self, OFFLOAD_MARK, None)
    if block is None:
        raise RuntimeError(getattr(self, NO_EXPERTS, None) or (
            "experts_implementation='fate_offload' is set but this experts module is not offloaded; "
            "call fate_lab.offload(model, config), or model.set_experts_implementation('eager')"))
    return block.runtime.layer_forward(block.m, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, _fate_experts_forward)


@dataclass(eq=False)
class OffloadedExperts:
    """What the runtime attaches to one HF experts module: its MoE layer index and the runtime."""

    m: int
    runtime: object


def attach(adapter: MoEAdapter, runtime: object) -> str:
    """Attach runtime to every experts module and switch the model to "fate_offload"; returns the previous
    implementation name (for `detach`)."""
    model = adapter.model
    prev = model.config._experts_implementation
    for m in range(adapter.num_moe_layers):
        mod = adapter.experts_module(m)
        if hasattr(mod, NO_EXPERTS):
            delattr(mod, NO_EXPERTS)
        setattr(mod, OFFLOAD_MARK, OffloadedExperts(m, runtime))
    model.set_experts_implementation(IMPLEMENTATION)
    return prev


def detach(adapter: MoEAdapter, prev_impl: str | None, no_experts: str | None = None) -> None:
    """Undo `attach`: the experts modules forget the runtime and the previous implementation returns. no_experts:
    the experts were not given back (no copy existed): the model stays on "fate_offload", whose every call then
    raises this message."""
    for m in range(adapter.num_moe_layers):
        mod = adapter.experts_module(m)
        if hasattr(mod, OFFLOAD_MARK):
            delattr(mod, OFFLOAD_MARK)
        if no_experts is not None:
            setattr(mod, NO_EXPERTS, no_experts)
    if prev_impl is not None and no_experts is None:
        adapter.model.set_experts_implementation(prev_impl)


def guard_forward(model: nn.Module, on_abort: Callable[[], None]) -> Callable[[], None]:
    """Wrap ``model.forward`` so that on_abort() runs when a BaseException that is not an Exception (Ctrl-C's
    KeyboardInterrupt, SystemExit) leaves it: torch runs ``always_call`` forward hooks on Exception only, so
    without this an interrupted forward kept the runtime's lock. Returns the undo. Written here (accelerate's
    ``add_hook_to_module`` wraps forward the same way) because only the abort path is needed."""
    had, prev = "forward" in model.__dict__, model.__dict__.get("forward")
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        try:
            return inner(*args, **kwargs)
        except Exception:
            raise
        except BaseException:
            on_abort()
            raise

    model.forward = forward

    def undo() -> None:
        if model.__dict__.get("forward") is forward:
            if had:
                model.forward = prev
            else:
                del model.forward

    return undo


def check_servable(adapter: MoEAdapter) -> None:
    """Refuse (NotImplementedError) a model whose experts modules fate_lab cannot serve, naming the family, the
    layout and what to do (`model.experts.expert_refusal`)."""
    for m in range(adapter.num_moe_layers):
        reason = expert_refusal(adapter.experts_module(m), adapter.family)
        if reason is not None:
            raise NotImplementedError(f"fate_lab cannot offload MoE layer {m}: {reason}")


@dataclass(frozen=True)
class Taken:
    """The caller's own expert Parameters, per MoE layer {module tensor name: Parameter}, while offloaded."""

    params: list[dict[str, nn.Parameter]]
    on_host: bool  # True: they still hold their bytes (host memory); False: their device storage was freed


def experts_state(adapter: MoEAdapter) -> str:
    """"present" (every routed-expert tensor holds its bytes), "meta" (shapes only, e.g. `load_without_experts`)
    or "empty" (taken by a runtime and not given back)."""
    tensors = [t for m in range(adapter.num_moe_layers)
               for t in adapter.experts_module(m).parameters(recurse=False)]
    if any(t.numel() == 0 for t in tensors):
        return "empty"
    return "meta" if any(t.is_meta for t in tensors) else "present"


def free_fused_experts(adapter: MoEAdapter, device: torch.device) -> Taken:
    """Replace every routed-expert tensor of the experts modules (weights and biases) by an empty one: the device
    keeps no routed expert.

    Returns the Parameters taken. On a CPU "device" they keep their bytes (host memory already: keeping them
    costs nothing, and the RAM store reads them in place); on an accelerator their storage is freed (the RAM
    store holds a host copy) and `restore_fused_experts` refills these same Parameters on close.
    """
    taken = []
    on_host = device.type == "cpu"
    for m in range(adapter.num_moe_layers):
        mod = adapter.experts_module(m)
        layer = {}
        for name in adapter.layouts[m].tensor_names().values():
            p = getattr(mod, name)
            layer[name] = p
            setattr(mod, name, nn.Parameter(torch.empty(0, dtype=p.dtype, device=device), requires_grad=False))
            if not on_host and not p.is_meta:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # frees the device copy, keeps the object
        taken.append(layer)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Taken(taken, on_host)


def put_back(adapter: MoEAdapter, taken: Taken) -> None:
    """Give the experts modules exactly the Parameters `free_fused_experts` took."""
    for m, layer in enumerate(taken.params):
        mod = adapter.experts_module(m)
        for name, p in layer.items():
            setattr(mod, name, p)


def restore_fused_experts(adapter: MoEAdapter, store: HostStore, taken: Taken, device: torch.device) -> None:
    """Refill the caller's own Parameters from the RAM store's host copy (taken at offload, in memory, never from
    a file) in the module's own layout, on the device, and put them back."""
    for m, layer in enumerate(taken.params):
        layout = adapter.layouts[m]
        parts = [store.fetch(m, e) for e in range(layout.num_experts)]
        for field, name in layout.tensor_names().items():
            rows = [getattr(w, field) for w in parts]  # canonical (R, H), (H, I), (R,), (H,)
            if layout.is_transposed and field in ("gate_up", "down"):
                rows = [t.T for t in rows]  # the module stores (H, R), (I, H)
            layer[name].data = torch.stack(rows).to(device=device, dtype=layer[name].dtype)  # (E, ...)
    put_back(adapter, taken)


class StepwiseForward(nn.Module):
    """`model(input_ids=[B, T])` run one token at a time with the KV cache, so every position after the
    first is a decode step of an offloaded model (prefetch, cache and on-demand precisions as in
    generation); the first, with no KV cache yet, is a one-token prefill, as it is in the runtime's and
    the simulator's one phase rule. For teacher-forced quality of the decode-time mix with
    `quant.quality_report`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, **_) -> "StepwiseOutput":
        """Logits [B, T, V] of input_ids [B, T], computed as a one-token prefill and T - 1 decode steps."""
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
