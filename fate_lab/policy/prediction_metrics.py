"""Prefetch metrics of predictors and selection rules: recall, precision and set size, per phase.

What this file is: `evaluate_rule` (a rule on cross-layer scores), `predict_trace` / `evaluate_predictor`
(any stateful predictor replayed token by token in the runtime's order) and `prefill_prediction` (the
prompt-wide union a prefill step prefetches), with the definitions of the design notes: prefetch recall
= of the experts a token truly uses in layer l+1, the fraction predicted; precision and mean predicted-set
size beside it; prefill and decode apart.
What it is not: a predictor or a rule (`predictors.py`, `rules.py`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from fate_lab.policy.predictors import Predictor
from fate_lab.policy.rules import SelectionRule


def _true_mask(true_experts: Tensor, num_experts: int) -> Tensor:
    """``[N, L, k]`` ids -> ``[N, L-1, E]`` mask of layer l+1's true experts."""
    nxt = true_experts[:, 1:]  # (N, L-1, k)
    m = torch.zeros(*nxt.shape[:2], num_experts, dtype=torch.bool)
    return m.scatter_(-1, nxt.long(), True)


def _metrics(pred: Tensor, true: Tensor, sel: Tensor | None = None) -> dict:
    """Recall/precision/set size from masks ``[N, L-1, E]`` on tokens ``sel`` (bool ``[N]``)."""
    if sel is not None:
        pred, true = pred[sel], true[sel]
    inter = (pred & true).sum(-1).float()  # (n, L-1)
    size = pred.sum(-1).float()
    recall = inter / true.sum(-1).clamp_min(1)
    precision = inter / size.clamp_min(1)  # an empty prediction has precision 0
    n = pred.shape[0]

    def mean(x: Tensor, dim=None) -> Tensor:
        return x.mean(dim) if n else torch.full(x.shape[1:] if dim == 0 else (), float("nan"))

    per_layer = [
        {"layer": l + 1, "recall": float(r), "precision": float(p), "mean_set_size": float(s)}
        for l, (r, p, s) in enumerate(zip(mean(recall, 0), mean(precision, 0), mean(size, 0), strict=False))
    ]
    return {
        "tokens": n,
        "recall": float(mean(recall)),
        "per_token_recall": recall.mean(1),  # (n,) each token's recall over the layers it predicts
        "precision": float(mean(precision)),
        "mean_set_size": float(mean(size)),
        "per_layer": per_layer,
    }


def _by_phase(pred: Tensor, true: Tensor, phase: Tensor | None) -> dict:
    out = {"all": _metrics(pred, true), "prefill": None, "decode": None}
    if phase is not None:
        phase = torch.as_tensor(phase)
        out["prefill"] = _metrics(pred, true, phase == 0)
        out["decode"] = _metrics(pred, true, phase == 1)
    return out


def evaluate_rule(pred_scores: Tensor, true_experts: Tensor, rule: SelectionRule, phase: Tensor | None = None) -> dict:
    """Per-token prefetch recall, precision and set size of a rule on cross-layer scores.

    ``pred_scores [N, L-1, E]`` (row l predicts layer l+1), ``true_experts [N, L, k]``.
    Returns ``{"all", "prefill", "decode"}`` (the last two None without ``phase``), each
    ``{tokens, recall, precision, mean_set_size, per_layer: [{layer, recall, ...}]}``;
    overall numbers are means over (token, layer) pairs; ``per_token_recall [n]`` is each token's recall (its
    spread is the mean's sampling error: `study.verdict.mean_uncertainty`).
    """
    N, Lm1, E = pred_scores.shape
    pred = rule.select(pred_scores.reshape(-1, E)).reshape(N, Lm1, E)
    return _by_phase(pred, _true_mask(true_experts, E), phase)


def predict_trace(
    predictor: Predictor,
    experts: Tensor,
    next_scores: Tensor | None = None,
    prompt_id: Tensor | None = None,
) -> list[list[list[int] | None]]:
    """Replay a predictor token by token; ``out[t][l]`` = ids predicted for layer l (``out[t][0]`` None).

    Per token: observe(l) then predict(l) for layer l+1, as the runtime does (the prediction
    for l+1 is made while layer l computes). ``reset`` is called when ``prompt_id`` changes.
    """
    ex = torch.as_tensor(experts)
    N, L, _ = ex.shape
    pids = None if prompt_id is None else torch.as_tensor(prompt_id).tolist()
    predictor.reset()
    out: list[list[list[int] | None]] = []
    for t in range(N):
        if pids is not None and t > 0 and pids[t] != pids[t - 1]:
            predictor.reset()
        row: list[list[int] | None] = [None]
        for l in range(L):
            predictor.observe(l, ex[t, l])
            if l < L - 1:
                s = None if next_scores is None else next_scores[t, l]
                row.append(list(predictor.predict(l, s, ex[t, l])))
        out.append(row)
    return out


def predictions_to_mask(predictions: list[list[list[int] | None]], num_experts: int) -> Tensor:
    """Predicted ids per token/layer -> mask ``[N, L-1, E]`` of the predictions for layers 1..L-1."""
    N, L = len(predictions), len(predictions[0])
    m = torch.zeros(N, L - 1, num_experts, dtype=torch.bool)
    for t, row in enumerate(predictions):
        for l in range(1, L):
            if row[l]:
                m[t, l - 1, row[l]] = True
    return m


def evaluate_predictor(
    predictor: Predictor,
    experts: Tensor,
    next_scores: Tensor | None = None,
    phase: Tensor | None = None,
    prompt_id: Tensor | None = None,
    num_experts: int | None = None,
) -> dict:
    """Same metrics as ``evaluate_rule`` for any (stateful) predictor, replayed token by token."""
    if num_experts is None:
        num_experts = next_scores.shape[-1] if next_scores is not None else int(torch.as_tensor(experts).max()) + 1
    preds = predict_trace(predictor, experts, next_scores, prompt_id)
    return _by_phase(predictions_to_mask(preds, num_experts), _true_mask(torch.as_tensor(experts), num_experts), phase)


def prefill_prediction(
    pred_scores: Tensor, true_experts: Tensor, rule: SelectionRule, max_experts: int | None = None
) -> dict:
    """Prefill: predict each layer for a whole prompt at once and score the union.

    ``pred_scores [T, L-1, E]`` and ``true_experts [T, L, k]`` for ONE prompt. Per layer l+1 the
    predicted set is the union of the per-token sets, ordered by popularity (how many tokens
    predicted each expert, then summed score) and cut to ``max_experts`` if given. Recall and
    precision compare it with the union of the experts the prompt truly uses. Returns
    ``{recall, precision, mean_set_size, per_layer: [{layer, predicted, counts, recall,
    precision, set_size, true_set_size}]}``.
    """
    T, Lm1, E = pred_scores.shape
    per_layer = []
    for l in range(Lm1):
        s = pred_scores[:, l]  # (T, E)
        mask = rule.select(s)  # (T, E)
        counts = mask.sum(0)  # (E,) popularity of each predicted expert
        summed = (s.float() * mask).sum(0)
        ids = [e for e in range(E) if counts[e] > 0]
        ids.sort(key=lambda e: (-int(counts[e]), -float(summed[e]), e))
        if max_experts is not None:
            ids = ids[:max_experts]
        true = set(true_experts[:, l + 1].reshape(-1).tolist())
        hit = len(true.intersection(ids))
        per_layer.append({
            "layer": l + 1,
            "predicted": ids,
            "counts": [int(counts[e]) for e in ids],
            "recall": hit / max(len(true), 1),
            "precision": hit / max(len(ids), 1),
            "set_size": len(ids),
            "true_set_size": len(true),
        })
    n = max(len(per_layer), 1)
    return {
        "recall": sum(r["recall"] for r in per_layer) / n,
        "precision": sum(r["precision"] for r in per_layer) / n,
        "mean_set_size": sum(r["set_size"] for r in per_layer) / n,
        "per_layer": per_layer,
    }
