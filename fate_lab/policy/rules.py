"""Prediction scores and selection rules: how a predicted score distribution becomes a predicted set.

What this file is: the host-side scores (`scores_from_logits`, `next_layer_scores`: a router applied to a
gate input; `cross_layer_scores`: Fate's cross-layer gate over a whole trace; `RouterScores`: every MoE
layer's router weight on the host, the object drivers hand to a predictor) and the *selection rules*
(frozen dataclasses) that turn scores ``[T, E]`` into a set: ``TopK``, ``TopKPlus`` (MindSpore reference
code), ``Percentile`` (the paper's rule), ``CumulativeProb``, ``CountBudget``.
What it is not: a predictor (`predictors.py` keeps per-sequence state) or a metric (`prediction_metrics.py`).
No device, no thread, no model here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

# ----------------------------------------------------------------------------- scores


def scores_from_logits(logits: Tensor, scoring: str = "softmax") -> Tensor:
    """Router logits ``[..., E]`` -> scores: softmax probabilities or per-expert sigmoids."""
    if scoring == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits.float())
    raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")


def next_layer_scores(router_weight: Tensor, gate_input: Tensor, scoring: str = "softmax",
                      bias: Tensor | None = None) -> Tensor:
    """Fate's host-side step: layer l+1's router weight ``[E, H]`` (fp32, on the host, plus its logit
    bias ``[E]`` where the router has one) applied to layer l's gate input ``[T, H]`` -> scores ``[T, E]``.
    The runtime and the simulator both call this, with the same shapes, so their predicted sets agree
    bit for bit."""
    x = gate_input.detach().to("cpu", torch.float32)  # (T, H) the gate input goes to the host
    return scores_from_logits(torch.nn.functional.linear(x, router_weight, bias), scoring)  # (T, E)


def cross_layer_scores(gate_inputs: Tensor, router_weights: Sequence[Tensor], scoring: str = "softmax",
                       router_biases: Sequence[Tensor] | None = None) -> Tensor:
    """Fate's cross-layer gate: scores for layer l+1 from layer l's gate input, ``[N, L-1, E]`` (plus each
    router's logit bias ``[E]`` where given)."""
    N, L, H = gate_inputs.shape
    if len(router_weights) != L:
        raise ValueError(f"need one router weight [E, H] per MoE layer: got {len(router_weights)} for L={L}")
    logits = torch.stack(
        [gate_inputs[:, l].float() @ router_weights[l + 1].float().T
         + (0.0 if router_biases is None else router_biases[l + 1].float()) for l in range(L - 1)], dim=1
    )  # (N, L-1, E)
    return scores_from_logits(logits, scoring)


class RouterScores:
    """Every MoE layer's router weight ``[E, H]`` (and logit bias ``[E]``, if any) in fp32 on the host, and how
    its logits become scores: the routers a trace's weights reproduce (linear ones)."""

    def __init__(self, weights: Sequence[Tensor], scoring: str = "softmax",
                 biases: Sequence[Tensor | None] | None = None):
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
        self.weights = [w.detach().to("cpu", torch.float32) for w in weights]  # each (E, H)
        if biases is not None and len(biases) != len(self.weights):
            raise ValueError(f"need one router bias (or None) per router weight: got {len(biases)} for "
                             f"{len(self.weights)}")
        self.biases = [None if b is None else b.detach().to("cpu", torch.float32).reshape(-1)
                       for b in (biases or [None] * len(self.weights))]  # each (E,) or None
        self.scoring = scoring

    def __len__(self) -> int:
        return len(self.weights)

    def scores(self, m: int, gate_input: Tensor) -> Tensor:
        """Router m's scores ``[T, E]`` for a gate input ``[T, H]`` (layer m+1's router on layer m's input
        is Fate's prediction)."""
        return next_layer_scores(self.weights[m], gate_input, self.scoring, self.biases[m])


# ----------------------------------------------------------------------------- selection rules


class SelectionRule:
    """Base of the selection rules: ``select`` gives a mask, ``order`` most-probable-first ids."""

    def select(self, scores: Tensor) -> Tensor:  # pragma: no cover - interface
        """Boolean mask ``[T, E]`` of the predicted set for each row of ``scores [T, E]``."""
        raise NotImplementedError

    @staticmethod
    def order(scores: Tensor) -> Tensor:
        """Expert ids sorted most probable first, ``[T, E]`` (stable: ties by lower id)."""
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices

    def count(self, row: list[float]) -> int | None:
        """How many experts one row's set holds, computed in plain Python; None: no fast path."""
        return None

    def ids_row(self, row: list[float]) -> list[int]:
        """Predicted ids of ONE row of scores (a decode token), most probable first.

        The decode path of the runtime and the simulator: plain Python over E floats instead of
        a dozen small tensor ops (5-10x faster on a host CPU); same set as `ids` (ties by lower id).
        """
        n = self.count(row)
        if n is None:
            return self.ids(torch.tensor([row]))[0]
        return sorted(range(len(row)), key=lambda e: (-row[e], e))[:n]

    def ids(self, scores: Tensor) -> list[list[int]]:
        """Predicted ids per row, most probable first."""
        scores = torch.as_tensor(scores).reshape(-1, scores.shape[-1])
        mask = self.select(scores)  # (T, E)
        order = self.order(scores)  # (T, E)
        n = mask.sum(-1).tolist()
        return [row[:k] for row, k in zip(order.tolist(), n, strict=False)]  # the mask is always a prefix of the order


def _topn_mask(scores: Tensor, n: int | Tensor) -> Tensor:
    """Mask of the ``n`` highest scores per row (ties by lower id); ``n`` may be per row."""
    T, E = scores.shape
    order = SelectionRule.order(scores)  # (T, E)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(E).expand(T, E))  # rank[t, e] = position of e
    n = torch.as_tensor(n).reshape(-1, 1) if torch.is_tensor(n) else n
    return rank < n


@dataclass(frozen=True)
class TopK(SelectionRule):
    """The k most probable experts (plain top-k of the predicted distribution)."""

    k: int

    def select(self, scores: Tensor) -> Tensor:
        return _topn_mask(scores, min(self.k, scores.shape[-1]))

    def count(self, row: list[float]) -> int:
        return min(self.k, len(row))


@dataclass(frozen=True)
class TopKPlus(SelectionRule):
    """Top-(k + alpha): the fixed over-provisioning of the MindSpore reference code."""

    k: int
    alpha: int = 1

    def select(self, scores: Tensor) -> Tensor:
        return _topn_mask(scores, min(self.k + self.alpha, scores.shape[-1]))

    def count(self, row: list[float]) -> int:
        return min(self.k + self.alpha, len(row))


@dataclass(frozen=True)
class Percentile(SelectionRule):
    """Every expert scoring strictly above the q-th percentile of the token's own distribution.

    The paper's rule (q=75). Because the percentile is taken over the token's own E scores,
    it selects a fixed count — about ``E * (1 - q/100)`` experts (15 of 60 at q=75, with
    linear interpolation and distinct scores) — whatever the distribution's shape. Always show
    its recall beside its precision and set size.
    """

    q: float = 75.0

    def select(self, scores: Tensor) -> Tensor:
        thr = torch.quantile(scores.float(), self.q / 100.0, dim=-1, keepdim=True)  # (T, 1)
        mask = scores > thr
        empty = ~mask.any(-1)  # all-equal rows: fall back to the single best
        if empty.any():
            mask[empty] = _topn_mask(scores[empty], 1)
        return _topn_mask(scores, mask.sum(-1))  # same set, ties resolved like `order`

    def count(self, row: list[float]) -> int:
        v = sorted(row)  # torch.quantile's linear interpolation, in float64 (same count unless a score
        pos = self.q / 100.0 * (len(v) - 1)  # sits within float32 rounding of the threshold)
        lo = int(pos)
        thr = v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)
        return max(1, sum(1 for x in v if x > thr))


@dataclass(frozen=True)
class CumulativeProb(SelectionRule):
    """The smallest most-probable-first set whose (normalised) score mass reaches ``p``."""

    p: float = 0.9

    def select(self, scores: Tensor) -> Tensor:
        s = scores.float()
        s = s / s.sum(-1, keepdim=True).clamp_min(1e-12)
        sorted_s = torch.sort(s, dim=-1, descending=True, stable=True).values  # (T, E)
        before = sorted_s.cumsum(-1) - sorted_s  # mass of the experts ranked above
        n = (before < self.p - 1e-7).sum(-1).clamp_min(1)  # (T,)
        return _topn_mask(scores, n)


@dataclass(frozen=True)
class CountBudget(SelectionRule):
    """The ``n`` most probable experts, ``n`` fixed by how many transfers fit a compute window."""

    n: int

    def select(self, scores: Tensor) -> Tensor:
        return _topn_mask(scores, min(self.n, scores.shape[-1]))

    def count(self, row: list[float]) -> int:
        return min(self.n, len(row))


RULES = {
    "topk": TopK,
    "topk_plus": TopKPlus,
    "percentile": Percentile,
    "cumulative": CumulativeProb,
    "budget": CountBudget,
}


def rule_from_name(name: str, **params) -> SelectionRule:
    """Build a selection rule by name: topk(k), topk_plus(k, alpha), percentile(q), cumulative(p), budget(n)."""
    if name not in RULES:
        raise ValueError(f"unknown selection rule {name!r}; choose one of {sorted(RULES)}")
    return RULES[name](**params)
