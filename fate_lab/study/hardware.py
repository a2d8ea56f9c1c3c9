"""Facts about memory tiers and the paper's models, for sizing an edge deployment.

What it is: the memory-hierarchy table the suite starts from, and the published shapes of the
models the paper (and its neighbours) evaluate, instantiated on the ``meta`` device so their
byte counts come from the real HF module tree without downloading a weight.
What it is not: link emulation (``links``) or measured timings.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 1e9


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


def memory_tiers() -> list[dict]:
    """The memory hierarchy as rows (capacity, bandwidth) for a table."""
    return [{"tier": t.name, "capacity": t.capacity, "bandwidth": t.bandwidth} for t in MEMORY_TIERS]


def meta_model(name: str):
    """One of ``PAPER_MODELS`` built on the meta device (shapes only, no memory, no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in PAPER_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(PAPER_MODELS)}")
    fields = dict(PAPER_MODELS[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def memory_breakdown(model, name: str, dtype: torch.dtype = torch.bfloat16, context_len: int = 2048) -> dict:
    """Dense vs expert bytes, bytes per expert and KV cache of a model at ``dtype``."""
    from fate_lab.model.adapters import adapt

    ad = adapt(model)
    scale = torch.empty((), dtype=dtype).element_size() / next(model.parameters()).element_size()
    per_expert = ad.bytes_per_expert(dtype)
    experts = per_expert * ad.num_experts * ad.num_moe_layers
    dense = int(ad.dense_bytes() * scale)
    kv = ad.kv_bytes_per_token(dtype) * context_len
    return {
        "model": name, "dtype": str(dtype).replace("torch.", ""), "moe_layers": ad.num_moe_layers,
        "experts_per_layer": ad.num_experts, "top_k": ad.top_k, "bytes_per_expert": per_expert,
        "dense_bytes": dense, "expert_bytes": experts, f"kv_bytes_at_{context_len}": kv,
        "expert_share": experts / (experts + dense),
        "active_expert_bytes_per_token": per_expert * ad.top_k * ad.num_moe_layers,
    }


def expert_transfer_ms(bytes_per_expert: int, link_gbps: float) -> float:
    """Milliseconds to move one expert over a link of ``link_gbps`` GB/s (bandwidth only)."""
    return bytes_per_expert / (link_gbps * GB) * 1e3
