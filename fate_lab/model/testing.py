"""Tiny random MoE models of every family the installed transformers offers, for tests.

What this file is: `tiny_config(family)` / `tiny_model(family, seed)` build a few-layer, hidden-64
*ForCausalLM with random weights in about a second. The six families fate_lab started with keep
hand-picked sizes (expert counts and top-k differ between them, so that no test passes by a shared
accident); every other family is shrunk generically from its config class's defaults (`_shrink`),
with a named override only where the defaults cannot build a tiny model (`_OVERRIDES`).
`family_table()` builds and generates with a tiny model of every module `families.py` lists (a text
tower, forward only, where the module has no causal-LM class) and says which work here, and why not.

What it is not: these models are untrained; their text is noise. The trained default model lives
in `data/` and is loaded elsewhere. Nothing here downloads anything.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedModel

from fate_lab.model.checkpoint import fp32_names
from fate_lab.model.families import (
    base_model_class,
    experts_interface_families,
    experts_interface_modules,
    text_tower_types,
)

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

# The first six families: sizes chosen so that E, k, layer layout and router options all differ.
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

# --- the generic shrink --------------------------------------------------------------------------
MAX_TINY_PARAMS = 20_000_000  # a shrunk model above this was not shrunk: refuse to build it
LAYERS = 3  # decoder layers of a shrunk model: room for a dense first layer and two MoE layers
_SIZES = dict(  # config field -> tiny value, set wherever the config class has the field
    vocab_size=128, hidden_size=64, num_attention_heads=4, head_dim=16, intermediate_size=96,
    max_position_embeddings=256, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    shared_intermediate_size=48, moe_shared_expert_intermediate_size=48, shared_experts_intermediate_size=48,
    dense_intermediate_size=96, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    qk_head_dim=24, sliding_window=32, vocab_size_per_layer_input=128, tie_word_embeddings=False,
)
_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")  # E, 8
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts")  # k, <= 2
_DENSE_PREFIX = ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")  # -> 1 where > 0
_SMALL_WORDS = ("size", "dim", "rank", "heads", "state", "topk", "window", "length", "budget", "vocab")
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

# Per family: what the shrunk defaults cannot get right by themselves (each one a named reason).
_OVERRIDES: dict[str, dict] = {
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"]),  # default None: the model cannot build
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),  # periods of 8 layers; 4 layers hold both kinds and two MoE layers
    "gemma4_text": dict(enable_moe_block=True, per_layer_config={}, num_kv_shared_layers=0,
                        hidden_size_per_layer_input=16),  # MoE is off by default
    # the default is all-Mamba, and generate needs one attention layer to measure the cache
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "dots3_note_text": dict(per_layer_config={}, head_dim=24),  # SWA head_dim = qk_nope + qk_rope
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                           indexer_compress_ratio=4),  # its indexed attention has no default sizes
    # two attention blocks per decoder layer (num_hidden_layers = 2 x num_layers): 2 decoder layers; 2 zero
    # (identity) experts beside the 8 routed ones, where the default 256 would take nearly every route
    "longcat_flash": dict(num_hidden_layers=4, zero_expert_num=2),
    # per-layer lists of layer *indices* (which layer indexes, whose K/V a layer reads) cannot be resampled;
    # one indexed layer between two sliding ones, each reading its own K/V, and two MoE layers
    "kolibri1_1": dict(layer_types=["sliding_attention", "indexed_attention", "sliding_attention"], index_layers=[1],
                       kv_source_layers=[0, 1, 2], mlp_only_layers=[0], index_num_heads=2),
}


def _resample(values: list, n: int) -> list:
    """n entries of a per-layer list: its first n, with every distinct value of the list kept."""
    out = list(values[:n])
    missing = [v for i, v in enumerate(values) if v not in values[:i] and v not in out]
    for j, v in enumerate(missing[: n - 1]):
        out[n - 1 - j] = v
    return out


def _shrink(family: str) -> dict:
    """Keyword arguments that shrink the defaults of family's config class to a tiny model."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[family]().to_dict()
    fields = set(defaults) | set(getattr(CONFIG_MAPPING[family], "__dataclass_fields__", {}))
    n_default = defaults.get("num_hidden_layers")
    kw: dict = {k: v for k, v in _SIZES.items() if k in fields}
    kw["num_hidden_layers"] = LAYERS
    if defaults.get("num_key_value_heads") is not None:
        kw["num_key_value_heads"] = 4 if defaults.get("kv_lora_rank") else 2
    if defaults.get("kv_lora_rank") and "head_dim" in kw:
        kw["head_dim"] = kw["qk_rope_head_dim"]  # MLA families use head_dim as the rope dim
    if "q_lora_rank" in fields and defaults.get("q_lora_rank"):
        kw["q_lora_rank"] = 32
    kw.update({k: 8 for k in _EXPERTS if k in fields})
    kw.update({k: min(int(defaults.get(k) or 2), 2) for k in _TOP_K if k in fields})
    kw.update({k: 1 for k in _DENSE_PREFIX if (defaults.get(k) or 0) > 0})
    kw.update({k: 1 for k in ("n_shared_experts", "num_shared_experts") if k in fields and defaults.get(k) is None})
    if "moe_layer_end_index" in fields:
        kw["moe_layer_end_index"] = LAYERS - 1
    for group in ("n_group", "num_expert_group"):
        if (defaults.get(group) or 1) > 1:
            kw[group], kw["topk_group"] = 4, 2
    for k, v in defaults.items():
        if k in kw or isinstance(v, bool):
            continue
        if k.endswith("token_id"):
            kw[k] = [2] if isinstance(v, list) else _TOKEN_IDS.get(k, 3)
        elif isinstance(v, int) and v > 64 and any(word in k for word in _SMALL_WORDS):
            kw[k] = 16
        elif isinstance(v, list) and n_default and len(v) == n_default and n_default != LAYERS:
            kw[k] = [4 if "heads" in k else x for x in _resample(v, LAYERS)]
    kw.update(_OVERRIDES.get(family, {}))
    return kw


def tiny_config(family: str, **overrides) -> PretrainedConfig:
    """A tiny config of an MoE family (hidden 64, 2-4 layers, vocab 128); overrides win."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family in _TINY:
        return CONFIG_MAPPING[family](**{**_COMMON, **_TINY[family], **overrides})
    known = set(experts_interface_families()) | set(text_tower_types().values())
    if family not in known:
        raise ValueError(f"no tiny config for {family!r}: it is not a causal-LM or text-tower model type whose "
                         f"modeling uses transformers' experts interface; known: {sorted(known)}")
    return CONFIG_MAPPING[family](**{**_shrink(family), **overrides})


def _router_params(model: torch.nn.Module):
    """(router weight, correction bias or None) of every MoE block, found by the adapter's discovery."""
    from fate_lab.model.routers import find_router

    for mod in model.modules():
        if getattr(mod, "has_gate", None) is not None and hasattr(mod, "is_transposed"):
            found = find_router(model, mod)
            if found is not None:
                yield found


def _model_class(family: str) -> type:
    """The *ForCausalLM class of a causal family, else the base text model class of a text tower."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config_class = CONFIG_MAPPING[family]
    if family in experts_interface_families() or family in _TINY:
        return MODEL_FOR_CAUSAL_LM_MAPPING[config_class]
    return base_model_class(family)


def tiny_model(
    family: str, seed: int = 0, dtype: torch.dtype = torch.float32, router_std: float = 0.25, **overrides
) -> PreTrainedModel:
    """An eval-mode random *ForCausalLM (a base text model for a text tower), deterministic for seed; routers
    get std router_std.

    HF initialises routers with std 0.02 (or zeros), which makes every token's scores nearly equal;
    router_std 0.25 gives logits of std ~2 on a hidden-64 model, so routing is decisive but the
    second expert's weight is not negligible. Correction biases (DeepSeek-V3's
    `e_score_correction_bias` and its kin) and expert biases (gpt-oss) are made random too, so that tests
    see them change choices and outputs. In bf16/fp16 the tensors from_pretrained keeps in float32
    (`_keep_in_fp32_modules_strict`, e.g. DeepSeek's router) stay float32, as a loaded model has them.
    """
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model_class(family)._from_config(config)
        with torch.no_grad():
            for router in _router_params(model):
                for p in router.weights:
                    p.normal_(0.0, router_std)
                for b in router.biases:
                    b.normal_(0.0, 0.1)
            for mod in model.modules():  # biases travel with their expert: make them matter (gpt-oss)
                if getattr(mod, "has_bias", False) and hasattr(mod, "down_proj_bias"):
                    for name, p in mod.named_parameters(recurse=False):
                        if name.endswith("_bias"):
                            p.normal_(0.0, 0.1)
    keep = fp32_names(model, dtype)  # what from_pretrained keeps in float32 at this dtype (routers, biases)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name not in keep and t.is_floating_point():
                t.data = t.data.to(dtype)
    return model.eval()


# --- which families build here ----------------------------------------------------------------------
@dataclass(frozen=True)
class FamilyStatus:
    """One experts-interface modeling module: the model type built and whether a tiny model works here."""

    module: str  # transformers.models.<module>
    family: str | None  # the model type built (causal LM, else the base text tower), None when neither exists
    builds: bool  # tiny_model(family) builds and runs (a causal LM greedy-generates 3 tokens)
    generates: bool  # a causal LM (a text tower only runs forward)
    reason: str  # why not, or "" when it builds


def family_status(module: str, types: tuple[str, ...]) -> FamilyStatus:
    """Build a tiny model of one module and generate 3 tokens (a text tower: one forward); say why not."""
    causal = [t for t in types if t in experts_interface_families()]
    family = causal[0] if causal else text_tower_types().get(module)
    if family is None:
        return FamilyStatus(module, None, False, False, f"neither a causal-LM class nor a base text model among "
                                                        f"its model types {list(types)}")
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in _model_class(family)._from_config(tiny_config(family)).parameters())
        if size > MAX_TINY_PARAMS:
            return FamilyStatus(module, family, False, bool(causal), f"the shrunk config still holds {size:,} "
                                f"parameters (> {MAX_TINY_PARAMS:,}): fields the generic shrink does not know")
        model = tiny_model(family)
        ids = torch.randint(3, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            if causal:
                model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
            else:
                model(input_ids=ids)
    except Exception as err:  # noqa: BLE001 - the table reports every failure by name
        return FamilyStatus(module, family, False, bool(causal), f"{type(err).__name__}: "
                                                                 f"{str(err).strip().splitlines()[-1][:200]}")
    return FamilyStatus(module, family, True, bool(causal), "" if causal else
                        "text tower only: no causal-LM class, so forward works but generate does not")


def family_table() -> list[FamilyStatus]:
    """Every experts-interface module of the installed transformers, classified (slow: builds each)."""
    return [family_status(module, types) for module, types in experts_interface_modules().items()]


def supported_families() -> tuple[str, ...]:
    """Causal-LM model types whose tiny model builds and generates here (slow the first time)."""
    return _supported()


@functools.lru_cache(maxsize=1)
def _supported() -> tuple[str, ...]:
    """Cached `supported_families`."""
    return tuple(s.family for s in family_table() if s.builds and s.generates)
