"""Tiny random MoE models of every supported family, for tests.

What this file is: `tiny_config(family)` / `tiny_model(family, seed)` build a few-layer,
hidden-64 *ForCausalLM with random weights in well under a second, with expert counts and
top-k that differ between families so that no test passes by a shared accident.

What it is not: these models are untrained; their text is noise. The trained default model
lives in `data/` and is loaded elsewhere.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

_DEEPSEEK = dict(
    num_hidden_layers=3,
    first_k_dense_replace=1,  # layer 0 is a dense MLP, layers 1-2 are MoE
    intermediate_size=96,  # the dense MLP
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_key_value_heads=4,
)

# Per family: sizes chosen so that E, k, layer layout and router options all differ.
_TINY: dict[str, dict] = {
    "qwen2_moe": dict(
        num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    ),
    "qwen3_moe": dict(
        num_hidden_layers=3, num_experts=6, num_experts_per_tok=3, norm_topk_prob=True,
        intermediate_size=96, moe_intermediate_size=24, head_dim=16,
        mlp_only_layers=[1],  # a dense layer in the middle: moe_layers == [0, 2]
    ),
    "olmoe": dict(
        num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        intermediate_size=32, tie_word_embeddings=True,  # tied, to test byte counting
    ),
    "mixtral": dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=40),
    "deepseek_v2": dict(
        _DEEPSEEK, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
    ),
    "deepseek_v3": dict(
        _DEEPSEEK, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
    ),
}


def tiny_config(family: str, **overrides) -> PretrainedConfig:
    """A tiny config of an MoE family (hidden 64, 2-3 layers, vocab 128); overrides win."""
    if family not in _TINY:
        raise ValueError(f"no tiny config for {family!r}; known: {tuple(_TINY)}")
    return AutoConfig.for_model(family, **{**_COMMON, **_TINY[family], **overrides})


def tiny_model(
    family: str, seed: int = 0, dtype: torch.dtype = torch.float32, router_std: float = 0.25, **overrides
) -> PreTrainedModel:
    """An eval-mode random *ForCausalLM, deterministic for seed; routers get std router_std.

    HF initialises routers with std 0.02, which makes every token's scores nearly equal;
    router_std 0.25 gives logits of std ~2 on a hidden-64 model, so routing is decisive
    but the second expert's weight is not negligible. DeepSeek-V3's correction bias is
    made random too, so that tests see it change choices.
    """
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is None or not hasattr(layer.mlp, "experts"):
                    continue
                gate.weight.normal_(0.0, router_std)
                if hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.normal_(0.0, 0.1)
    return model.to(dtype).eval()
