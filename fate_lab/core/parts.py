"""The policies a config names, built once for every driver: the predictor and the lossy miss rule.

What this file is: `build_predictor` (cross-layer gate, activation path, or learned probes loaded and
checked against the model's shape) and `build_miss_policy` (the lossy decode rule, with its similarity
table checked against the shape). One function each, so no two drivers can build different policies from
one config. What it is not: the policies themselves (`fate_lab/policy/`), nor a driver.
"""
from __future__ import annotations

from fate_lab.core.config import PREDICTORS, OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.policy.lossy import MissPolicy
from fate_lab.policy.predictors import ActivationMatrix, ActivationPath, CrossLayerGate, Predictor
from fate_lab.policy.rules import TopK


def build_predictor(config: OffloadConfig, shape: ModelShape) -> Predictor | None:
    """The predictor of a config; "learned_gate" loads and checks the probes, from ``config.prefetch.probes`` or else
    from the model's own folder (``shape.source``)."""
    p = config.prefetch.predictor
    if p is None:
        return None
    if p == "cross_layer_gate":
        return CrossLayerGate(config.prefetch.rule if config.prefetch.rule is not None else TopK(shape.top_k))
    if p == "activation_path":
        return ActivationPath()
    if p == "activation_matrix":
        import torch

        matrices = config.prefetch.activation_collection
        seed = None if matrices is None else torch.tensor(matrices)
        return ActivationMatrix(shape.num_moe_layers, shape.num_experts, collection=seed)
    if p == "learned_gate":
        from fate_lab.policy.probes import LearnedGate, load_probes

        probes = load_probes(config.prefetch.probes or shape.source or None)
        probes.check(shape.num_moe_layers, shape.num_experts, shape.hidden)
        return LearnedGate(probes)
    raise ValueError(f"OffloadConfig.predictor={p!r}; choose one of {list(PREDICTORS)}")


def build_miss_policy(config: OffloadConfig, shape: ModelShape) -> MissPolicy | None:
    """The lossy decode rule of a config (None: lossless); substitute loads the similarity table (from
    ``config.lossy.similarity`` or else the model's own folder) and checks it against the shape."""
    if config.lossy.kind is None:
        return None
    table = None
    if config.lossy.kind == "substitute":
        from fate_lab.policy.similarity import FIT_COMMAND, load_similarity

        table = load_similarity(config.lossy.similarity or shape.source or None)
        if (table.num_layers, table.num_experts) != (shape.num_moe_layers, shape.num_experts):
            raise ValueError(f"the expert similarity table is for {table.num_layers} MoE layers x {table.num_experts} "
                             f"experts, the model has {shape.num_moe_layers} x {shape.num_experts}: compute one for "
                             f"this model ({FIT_COMMAND}) and set similarity=DIR")
    lossy = config.lossy
    return MissPolicy(lossy.kind, lossy.threshold, table, lossy.min_similarity, lossy.standin_window)
