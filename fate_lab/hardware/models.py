"""Published facts of the models the paper (and its neighbours) evaluate, and the memory tiers.

What this file is: the memory-hierarchy table the suite starts from (`MEMORY_TIERS`), and the published
configurations of real MoE models (`PAPER_MODELS`, the fields of each model card's config.json that
change memory), with `expert_bytes(name)`: the size of one routed expert, the one place a real
model's expert size is computed from (setups scale links to it).
What it is not: a model loader; `fate_lab.study.memory` builds these configs on the meta device.
"""
from __future__ import annotations

from dataclasses import dataclass

from fate_lab.hardware.roofline import ModelCosts


@dataclass(frozen=True)
class MemoryTier:
    """One level of the memory hierarchy, with typical capacity and bandwidth ranges."""

    name: str
    capacity: str
    bandwidth: str
    bandwidth_gbps: tuple[float, float]  # (low, high) GB/s, for plots


MEMORY_TIERS = (
    MemoryTier("GPU VRAM (HBM/GDDR)", "8–80 GB", "1–3 TB/s", (1000.0, 3000.0)),
    MemoryTier("Host RAM (DDR4/DDR5)", "64 GB–1 TB", "50–200 GB/s", (50.0, 200.0)),
    MemoryTier("NVMe SSD", "1–8 TB", "3–7 GB/s", (3.0, 7.0)),
    MemoryTier("PCIe 3.0 x16 link (host→GPU)", "—", "≈16 GB/s", (12.0, 16.0)),
    MemoryTier("PCIe 4.0 x16 link (host→GPU)", "—", "≈32 GB/s", (25.0, 32.0)),
)

# Published configurations (from each model's config.json on its model card), so byte counts can
# be computed on the meta device. Only the fields that change memory are given.
PAPER_MODELS: dict[str, dict] = {
    "Qwen1.5-MoE-A2.7B": dict(
        model_type="qwen2_moe", hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, intermediate_size=5632, vocab_size=151936,
        tie_word_embeddings=False, norm_topk_prob=False,
    ),
    "OLMoE-1B-7B": dict(
        model_type="olmoe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, intermediate_size=1024,
        vocab_size=50304, tie_word_embeddings=False,
    ),
    "Mixtral-8x7B": dict(
        model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336,
        vocab_size=32000, tie_word_embeddings=False,
    ),
}

# The paper's second model: DeepSeek-MoE-16B (deepseek-ai/deepseek-moe-16b-base config.json: hidden 2048,
# moe_intermediate_size 1408, 64 routed experts, top-6, 2 shared, 28 layers, the first dense). Its
# modeling code is not in transformers, so it has only these facts, no meta build.
OTHER_MODELS: dict[str, dict] = {
    "DeepSeek-MoE-16B": dict(model_type="deepseek", hidden_size=2048, num_hidden_layers=28,
                             moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6,
                             n_shared_experts=2, first_k_dense_replace=1),
}

_EXPERT_WIDTH = ("moe_intermediate_size", "intermediate_size")  # Mixtral/OLMoE name the expert width intermediate_size


# What one fp16 token of each published model costs (bytes per decoder layer's dense part, per routed expert, of
# the LM head; FLOPs at 2 per weight): one constant per model fact. Qwen1.5-MoE-A2.7B: its config built on the
# meta device and read by fate_lab.core.costs.model_costs (tests/core/test_costs.py re-derives it): attention
# 4 x 2048^2 + shared expert 3 x 2048 x 5632 + its gate + router + norms = 103.0 MB a layer, an expert
# 3 x 2048 x 1408 x 2 B = 17.3 MB, the head 151936 x 2048 x 2 B. DeepSeek-MoE-16B (no transformers class, by
# hand from its config.json): a MoE layer's attention 33.55 MB + 2 shared experts 34.60 MB + router and norms
# 0.27 MB = 68.43 MB, the first (dense, width 10944) layer 168.04 MB: 2015.59 MB over 28 layers = 71.99 MB a
# layer on average; the head 102400 x 2048 x 2 B = 419.4 MB.
PUBLISHED_COSTS: dict[str, ModelCosts] = {
    "Qwen1.5-MoE-A2.7B": ModelCosts(dense_layer_bytes=103030954.67, dense_layer_flops=103030954.67,
                                    expert_bytes=17301504, expert_flops=17301504, head_bytes=622329856,
                                    router_host_bytes=4 * 60 * 2048, num_layers=24),
    "DeepSeek-MoE-16B": ModelCosts(dense_layer_bytes=2015592448 / 28, dense_layer_flops=2015592448 / 28,
                                   expert_bytes=17301504, expert_flops=17301504, head_bytes=419430400,
                                   router_host_bytes=4 * 64 * 2048, num_layers=28),
}


def published_config(name: str) -> dict:
    """The published config fields of a model of `PAPER_MODELS` or `OTHER_MODELS`."""
    known = {**PAPER_MODELS, **OTHER_MODELS}
    if name not in known:
        raise ValueError(f"unknown published model {name!r}; known: {sorted(known)}")
    return dict(known[name])


def expert_bytes(name: str, bytes_per_weight: int = 2) -> int:
    """Bytes of one routed expert (gate, up and down projections) of a published model at 2 bytes a weight (fp16)."""
    cfg = published_config(name)
    width = next(cfg[k] for k in _EXPERT_WIDTH if k in cfg)
    return 3 * cfg["hidden_size"] * width * bytes_per_weight


def memory_tiers() -> list[dict]:
    """The memory hierarchy as rows (capacity, bandwidth) for a table."""
    return [{"tier": t.name, "capacity": t.capacity, "bandwidth": t.bandwidth} for t in MEMORY_TIERS]
