"""Device-memory planner: how many expert cache slots a byte budget buys.

budget = dense weights + KV cache (per token x context) + working buffers + cache_total x expert.
The working buffers are the ``top_k`` experts one layer computes with plus the prefetch
buffers, plus ``scratch_bytes`` (a packed-slot runtime's full-precision scratch that an expert
is dequantized into before it computes; 0 when slots hold full precision); below dense + KV +
buffers nothing can run. Pure arithmetic: this module allocates
nothing; per-layer splitting of ``cache_total`` is ``fate_lab.policy.allocation``'s job.
"""
from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class MemoryPlan:
    """How a device budget is spent (all sizes in bytes)."""

    budget_bytes: int  # what the runtime may use on the device
    dense_bytes: int  # embeddings, attention, norms, routers, shared experts
    kv_bytes: int  # KV cache for the whole context
    buffer_bytes: int  # top_k compute slots + prefetch buffers (+ dequantize scratch)
    expert_bytes: int  # one expert as cached (e.g. INT4)
    cache_total: int  # expert cache slots left, over all layers
    min_budget_bytes: int  # dense + KV + buffers: the least that can run
    num_layers: int
    top_k: int

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the expert cache."""
        return self.cache_total * self.expert_bytes



def _check_nonneg(**kw: int) -> None:
    for k, v in kw.items():
        if v < 0:
            raise ValueError(f"{k} must be >= 0, got {v}")


def min_budget(
    dense_bytes: int, kv_bytes_per_token: int, context_len: int, expert_bytes: int, top_k: int,
    prefetch_buffer_experts: int,
    scratch_bytes: int = 0,
) -> int:
    """The minimum working set in bytes: dense + KV + (top_k + prefetch buffers) experts + scratch."""
    return dense_bytes + kv_bytes_per_token * context_len + (top_k + prefetch_buffer_experts) * expert_bytes + \
        scratch_bytes


def plan_memory(
    budget_bytes: int,
    dense_bytes: int,
    kv_bytes_per_token: int,
    context_len: int,
    expert_bytes: int,
    num_layers: int,
    top_k: int,
    prefetch_buffer_experts: int,
    num_experts: int | None = None,
    scratch_bytes: int = 0,
) -> MemoryPlan:
    """Split a byte budget; ``cache_total`` is capped at ``num_layers * num_experts`` if given.

    Raises ValueError, stating the minimum in bytes and MiB, when the budget cannot hold the
    minimum working set.
    """
    _check_nonneg(budget_bytes=budget_bytes, dense_bytes=dense_bytes, kv_bytes_per_token=kv_bytes_per_token,
                  context_len=context_len, top_k=top_k, prefetch_buffer_experts=prefetch_buffer_experts,
                  scratch_bytes=scratch_bytes)
    if expert_bytes <= 0 or num_layers <= 0:
        raise ValueError(f"expert_bytes and num_layers must be > 0, got {expert_bytes}, {num_layers}")
    kv = kv_bytes_per_token * context_len
    buffers = (top_k + prefetch_buffer_experts) * expert_bytes + scratch_bytes
    need = min_budget(dense_bytes, kv_bytes_per_token, context_len, expert_bytes, top_k, prefetch_buffer_experts,
                      scratch_bytes)
    if budget_bytes < need:
        raise ValueError(
            f"budget {budget_bytes} bytes ({budget_bytes / MiB:.1f} MiB) is below the minimum working set "
            f"{need} bytes ({need / MiB:.1f} MiB) = dense {dense_bytes} + KV {kv} ({context_len} tokens) "
            f"+ buffers {buffers} ({top_k} + {prefetch_buffer_experts} experts"
            + (f" + {scratch_bytes} bytes of dequantize scratch" if scratch_bytes else "")
            + f"); raise the budget to at least "
            f"{need / MiB:.1f} MiB, shorten context_len, or use fewer prefetch buffers"
        )
    cache_total = (budget_bytes - need) // expert_bytes
    if num_experts is not None:
        cache_total = min(cache_total, num_layers * num_experts)
    return MemoryPlan(budget_bytes, dense_bytes, kv, buffers, expert_bytes, int(cache_total), need, num_layers, top_k)


def plan_from_slots(
    cache_total: int,
    dense_bytes: int,
    kv_bytes_per_token: int,
    context_len: int,
    expert_bytes: int,
    num_layers: int,
    top_k: int,
    prefetch_buffer_experts: int,
    scratch_bytes: int = 0,
) -> MemoryPlan:
    """The plan (and the byte budget it needs) when the budget is given as ``cache_total`` slots."""
    _check_nonneg(cache_total=cache_total)
    need = min_budget(dense_bytes, kv_bytes_per_token, context_len, expert_bytes, top_k, prefetch_buffer_experts,
                      scratch_bytes)
    return plan_memory(need + cache_total * expert_bytes, dense_bytes, kv_bytes_per_token, context_len,
                       expert_bytes, num_layers, top_k, prefetch_buffer_experts, scratch_bytes=scratch_bytes)


def plan_offload(config, *, num_layers: int, num_experts: int, top_k: int, slot_expert_bytes: int, dense_bytes: int,
                 kv_bytes_per_token: int, scratch_bytes: int = 0,
                 miss_curves=None) -> tuple[MemoryPlan, list[int], int]:
    """(plan, slots per MoE layer, prefetch buffers per pool) for an `OffloadConfig`: what the runtime
    allocates and the simulator models, from one function. ``miss_curves()`` supplies curves for
    allocation="miss_curve" when the config has none."""
    from fate_lab.policy.allocation import allocation_from_name

    cache = config.cache  # the part this plan reads (and the prefetch part's pools)
    prefetching = config.prefetch.predictor is not None
    buffers = config.prefetch.buffer_experts
    buffers = (top_k if prefetching else 0) if buffers is None else buffers
    if cache.budget is not None and cache.slots is not None:
        raise ValueError("give the budget either in bytes (budget=) or in expert slots (slots=), not both")
    pools = 2 * buffers  # two prefetch pools (even / odd layers)
    fixed = getattr(config, "slots_per_layer", None)
    if fixed is not None and not cache.all_resident:
        if len(fixed) != num_layers or any(not 0 <= c <= num_experts for c in fixed):
            raise ValueError(f"slots_per_layer={tuple(fixed)} must hold {num_layers} counts in [0, {num_experts}] "
                             f"(one per MoE layer)")
        plan = plan_from_slots(sum(fixed), dense_bytes, kv_bytes_per_token, cache.context_len, slot_expert_bytes,
                               num_layers, top_k, pools, scratch_bytes=scratch_bytes)
        from fate_lab.policy.placement import host_layer_set

        on_host = host_layer_set(getattr(config, "host", None), getattr(config, "host_layers", 0), num_layers)
        return plan, [c if cache.keep and m not in on_host else 0 for m, c in enumerate(fixed)], buffers
    if cache.budget is not None and not cache.all_resident:
        plan = plan_memory(cache.budget, dense_bytes, kv_bytes_per_token, cache.context_len, slot_expert_bytes,
                           num_layers, top_k, pools, num_experts=num_experts, scratch_bytes=scratch_bytes)
    else:
        slots = num_layers * num_experts
        if cache.slots is not None and not cache.all_resident:
            slots = min(cache.slots, slots)
        plan = plan_from_slots(slots, dense_bytes, kv_bytes_per_token, cache.context_len, slot_expert_bytes,
                               num_layers, top_k, pools, scratch_bytes=scratch_bytes)
    params: dict = {}
    if cache.allocation == "shallow":
        params = {"shallow_layers": cache.shallow_layers if cache.shallow_layers is not None
                  else max(1, round(num_layers / 8))}
    elif cache.allocation == "miss_curve":
        if cache.miss_curves is None and miss_curves is None:
            raise ValueError("allocation='miss_curve' needs miss curves: set OffloadConfig.miss_curves")
        params = {"curves": cache.miss_curves if cache.miss_curves is not None else miss_curves()}
    cache_total = plan.cache_total if cache.keep else 0
    from fate_lab.policy.placement import host_layer_set

    on_host = host_layer_set(getattr(config, "host", None), getattr(config, "host_layers", 0), num_layers)
    device = [m for m in range(num_layers) if m not in on_host]  # layers whose experts compute on the device
    if "curves" in params:
        params["curves"] = [params["curves"][m] for m in device]
    if "shallow_layers" in params:
        params["shallow_layers"] = min(params["shallow_layers"], max(1, len(device)))
    per_device = allocation_from_name(cache.allocation, **params).allocate(cache_total, len(device), num_experts) \
        if device else []
    slots_per_layer = [0] * num_layers
    for m, c in zip(device, per_device, strict=False):
        slots_per_layer[m] = c
    return plan, slots_per_layer, buffers
