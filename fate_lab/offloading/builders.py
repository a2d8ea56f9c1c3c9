"""What the runtime and the simulator both build from an `OffloadConfig`: the predictor and the lossy miss rule.

What this file is: `build_predictor` (cross-layer gate, activation path, or learned probes loaded and
checked against the model), `predictor_scores` (what a predictor reads for layer m+1 from layer m's
gate input) and `build_miss_policy` (the lossy decode rule, with its similarity table). One function
each, so the two drivers cannot build different policies from one config.
What it is not: the policies themselves (`fate_lab/policy/`), nor a driver.
"""
from __future__ import annotations

import torch

from fate_lab.offloading.config import OffloadConfig
from fate_lab.policy.lossy import MissPolicy
from fate_lab.policy.predictors import ActivationPath, CrossLayerGate, Predictor, TopK, next_layer_scores

PREDICTORS = (None, "cross_layer_gate", "activation_path", "learned_gate")


def model_source(model) -> str:
    """The folder a loaded model came from ('' for one built in memory): its probes and tables live there."""
    return str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")


def build_predictor(config: OffloadConfig, num_layers: int, num_experts: int, hidden_size: int,
                    top_k: int, model_dir: str | None = None) -> Predictor | None:
    """The predictor of a config (runtime and simulator alike); "learned_gate" loads and checks the probes,
    from ``config.probes`` or else from ``model_dir`` (the folder of the model being run)."""
    p = config.predictor
    if p is None:
        return None
    if p == "cross_layer_gate":
        return CrossLayerGate(config.rule if config.rule is not None else TopK(top_k))
    if p == "activation_path":
        return ActivationPath()
    if p == "learned_gate":
        from fate_lab.policy.learned import LearnedGate, load_probes

        probes = load_probes(config.probes or model_dir)
        probes.check(num_layers, num_experts, hidden_size)
        return LearnedGate(probes)
    raise ValueError(f"unknown predictor {p!r}; choose one of {list(PREDICTORS)}")


def predictor_scores(predictor: Predictor | None, m: int, gate_input: torch.Tensor, router_next: torch.Tensor,
                     scoring: str) -> torch.Tensor | None:
    """What the predictor reads for layer m+1 from layer m's gate input [T, H]: a learned gate's probe
    probabilities, the cross-layer gate's router product, or nothing (history predictors)."""
    if hasattr(predictor, "probes"):  # LearnedGate (a CrossLayerGate whose scores come from its probes)
        return predictor.scores(m, gate_input.detach().to("cpu", torch.float32))
    if isinstance(predictor, CrossLayerGate):
        return next_layer_scores(router_next, gate_input, scoring)
    return None


def build_miss_policy(config: OffloadConfig, num_layers: int, num_experts: int,
                      model_dir: str | None = None) -> MissPolicy | None:
    """The lossy decode rule of a config (None: lossless); substitute loads the similarity table (from
    ``config.similarity`` or else ``model_dir``, the folder of the model being run) and checks it."""
    if config.lossy is None:
        return None
    table = None
    if config.lossy == "substitute":
        from fate_lab.policy.similarity import load_similarity

        table = load_similarity(config.similarity or model_dir)
        if (table.num_layers, table.num_experts) != (num_layers, num_experts):
            raise ValueError(f"the expert similarity table is for {table.num_layers} MoE layers x {table.num_experts} "
                             f"experts, the model has {num_layers} x {num_experts}: compute one for this model "
                             f"(python -m fate_lab.policy.similarity --model DIR) and set similarity=DIR")
    return MissPolicy(config.lossy, config.lossy_threshold, table, config.min_similarity, config.standin_window)
