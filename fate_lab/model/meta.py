"""A model built from its config alone, on the meta device: shapes and dtypes, no weights.

What this file is: `model_class(config)` (the *ForCausalLM class of a config, else its base model class: a text
tower) and `meta_model(config)` (the model on the meta device, with its first routers materialised so that
`adapt` can read their semantics). `plan` and `ModelShape.from_config` size a model this way without its bytes.
What it is not: no checkpoint is read (`checkpoint.py` reads experts and dense tensors).
"""
from __future__ import annotations

import torch
from torch import nn

from fate_lab.model.folder import read_config


def model_class(config):
    """The *ForCausalLM class of config, else its base model class (a text tower)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from fate_lab.model.families import base_model_class

    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if base_model_class(config.model_type) is not None:
        return base_model_class(config.model_type)
    raise ValueError(f"model_type {config.model_type!r} has no causal-LM or base model class in transformers")


def meta_model(config, dtype: torch.dtype | None = None) -> nn.Module:
    """The model of a config (a PretrainedConfig, a config.json file or a checkpoint folder) built on the meta
    device: shapes and dtypes, no weights. The routers of its first MoE layers -- up to the first one the gate
    input alone can drive -- are materialised on the CPU with random weights (std 0.25, as `testing.tiny_model`
    does), so that `adapt(model)` can read their semantics off the modules; nothing else holds bytes."""
    from transformers import PretrainedConfig

    from fate_lab.model.adapters import experts_modules
    from fate_lab.model.routers import find_router

    config = config if isinstance(config, PretrainedConfig) else read_config(config)  # a folder or config.json
    with torch.device("meta"):
        model = model_class(config)._from_config(config, dtype=dtype or getattr(config, "dtype", None)
                                                 or torch.float32)
    hidden = int(config.get_text_config().hidden_size)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, _, experts in experts_modules(model):
            site = find_router(model, experts, hidden)
            if site is None:
                break
            for owner in [*site.router.modules(), site.block]:  # the router and the block's own tensors
                owner.to_empty(device="cpu", recurse=False)
                model._init_weights(owner)  # the family's own initial values (norm weights, scales)
            site = find_router(model, experts, hidden)
            for w in site.weights:
                w.copy_(torch.randn(w.shape, generator=g) * 0.25)
            for b in site.biases:
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            if set(site.missing) <= set(site.optional):
                break
    return model.eval()
