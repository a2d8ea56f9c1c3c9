"""The paper's observations as pure functions over a recorded trace.

- ``adjacent_cosine`` / ``cosine_matrix``: how similar the gate inputs of layers are (why a
  cross-layer gate works; Fate reports ~0.888 between adjacent layers on Qwen1.5-MoE);
- ``routing_flatness``: how flat each layer's routing is (why shallow layers are hard to
  predict and get cache first): entropy, top-1 probability, top-k mass, load imbalance.

Results are plain lists of dicts (one row per layer; ``pd.DataFrame(rows)`` if you like).
No plotting and no model here.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from fate_lab.policy.rules import scores_from_logits


def _phase_masks(n: int, phase: Tensor | None) -> dict[str, Tensor]:
    masks = {"all": torch.ones(n, dtype=torch.bool)}
    if phase is not None:
        phase = torch.as_tensor(phase)
        masks["prefill"], masks["decode"] = phase == 0, phase == 1
    return masks


def _mean_or_nan(x: Tensor) -> float:
    return float(x.mean()) if x.numel() else float("nan")


def _adjacent_cos(gate_inputs: Tensor) -> Tensor:
    """``[N, L-1]`` per-token cosine between the gate inputs of layers l and l+1."""
    x = torch.nn.functional.normalize(gate_inputs.float(), dim=-1)  # (N, L, H)
    return (x[:, :-1] * x[:, 1:]).sum(-1)


def adjacent_cosine(gate_inputs: Tensor, phase: Tensor | None = None) -> list[dict]:
    """Mean per-token cosine between gate inputs of layers l and l+1.

    ``gate_inputs [N, L, H]``. Rows ``{layer, next_layer, cosine, cosine_prefill,
    cosine_decode}``; the phase columns are present only when ``phase`` is given.
    """
    cos = _adjacent_cos(gate_inputs)  # (N, L-1)
    masks = _phase_masks(cos.shape[0], phase)
    rows = []
    for l in range(cos.shape[1]):
        row = {"layer": l, "next_layer": l + 1}
        for name, m in masks.items():
            row["cosine" if name == "all" else f"cosine_{name}"] = _mean_or_nan(cos[m, l])
        rows.append(row)
    return rows


def adjacent_cosine_per_token(gate_inputs: Tensor, pairs: list[int] | None = None) -> Tensor:
    """``[N]``: each token's cosine between adjacent layers' gate inputs, averaged over the pairs (l, l+1) for l
    in ``pairs`` (all pairs by default). Its mean is `adjacent_cosine`'s mean over those pairs; its spread over
    tokens is the mean's sampling error (`verdict.mean_uncertainty`)."""
    cos = _adjacent_cos(gate_inputs)  # (N, L-1)
    if pairs is not None:
        if not pairs or min(pairs) < 0 or max(pairs) >= cos.shape[1]:
            raise ValueError(f"pairs {pairs}: give layer indices l in [0, {cos.shape[1]}) of pairs (l, l+1)")
        cos = cos[:, list(pairs)]
    return cos.mean(1)


def cosine_matrix(gate_inputs: Tensor) -> Tensor:
    """``[L, L]`` mean per-token cosine between the gate inputs of every pair of layers."""
    x = torch.nn.functional.normalize(gate_inputs.float(), dim=-1)  # (N, L, H)
    return torch.einsum("nih,njh->ij", x, x) / x.shape[0]  # (L, L)


def routing_flatness(
    logits: Tensor,
    experts: Tensor | None = None,
    top_k: int | None = None,
    scoring: str = "softmax",
    phase: Tensor | None = None,
) -> list[dict]:
    """Per-layer flatness of the routing distribution and of the expert load.

    ``logits [N, L, E]``; ``experts [N, L, k]`` (the true routing; top-k of the logits if
    omitted). Per token: entropy of the normalised scores (nats), that over ``log E``, top-1
    probability, top-k mass; per layer: load imbalance (max load / mean load) and the load's
    coefficient of variation (std / mean, population std). One row per layer and phase
    (``phase`` = "all", and "prefill"/"decode" when ``phase`` is given).
    """
    N, L, E = logits.shape
    if experts is None:
        if top_k is None:
            raise ValueError("give experts [N, L, k] or top_k")
        experts = torch.topk(logits, top_k, dim=-1).indices
    experts = torch.as_tensor(experts)
    k = top_k if top_k is not None else experts.shape[-1]
    p = scores_from_logits(logits, scoring)
    p = p / p.sum(-1, keepdim=True)  # (N, L, E); sigmoid scores are normalised too
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # (N, L)
    top = torch.sort(p, dim=-1, descending=True).values  # (N, L, E)
    top1, topk = top[..., 0], top[..., :k].sum(-1)  # (N, L)
    rows = []
    for name, m in _phase_masks(N, phase).items():
        for l in range(L):
            load = torch.bincount(experts[m, l].reshape(-1), minlength=E).float()  # (E,)
            mean = load.mean()
            rows.append({
                "layer": l,
                "phase": name,
                "tokens": int(m.sum()),
                "entropy": _mean_or_nan(ent[m, l]),
                "normalized_entropy": _mean_or_nan(ent[m, l]) / math.log(E),
                "top1_prob": _mean_or_nan(top1[m, l]),
                "topk_mass": _mean_or_nan(topk[m, l]),
                "load_imbalance": float(load.max() / mean) if mean > 0 else float("nan"),
                "load_cv": float(load.std(unbiased=False) / mean) if mean > 0 else float("nan"),
            })
    return rows


def adjacent_cosine_baseline(gate_inputs: Tensor, seed: int = 0) -> list[dict]:
    """Reference for ``adjacent_cosine``: cosine between layer l of token t and layer l+1 of a *random other* token."""
    N = gate_inputs.shape[0]
    g = torch.Generator().manual_seed(seed)
    other = (torch.arange(N) + torch.randint(1, max(N, 2), (N,), generator=g)) % max(N, 1)  # never t itself when N > 1
    x = torch.nn.functional.normalize(gate_inputs.float(), dim=-1)  # (N, L, H)
    cos = (x[:, :-1] * x[other, 1:]).sum(-1)  # (N, L-1)
    return [{"layer": l, "next_layer": l + 1, "cosine": _mean_or_nan(cos[:, l])} for l in range(cos.shape[1])]
