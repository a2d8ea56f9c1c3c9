"""Expert predictors: "which experts will MoE layer l+1 need?" — pure policies plus their metrics.

Two layers of abstraction:

- *selection rules* (frozen dataclasses) turn a predicted score distribution ``[T, E]`` into a
  predicted set: ``TopK``, ``TopKPlus`` (MindSpore reference code), ``Percentile`` (the
  paper's rule), ``CumulativeProb``, ``CountBudget``;
- *predictors* (``Predictor`` subclasses) are the objects the runtime and the replay share:
  ``predict(layer, next_scores, cur_experts)`` returns the ids predicted for layer ``layer+1``,
  most probable first; ``observe(layer, experts)`` feeds the true routing of ``layer``.

Cross-layer scores (Fate): layer l's gate input times layer l+1's router weight, ``[N, L-1, E]``
(see ``cross_layer_scores``). Metrics follow DESIGN.md: prefetch recall, precision and mean
predicted-set size, prefill and decode separately. No device, no thread, no model here.
"""
from __future__ import annotations

import random
from collections import Counter
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


def next_layer_scores(router_weight: Tensor, gate_input: Tensor, scoring: str = "softmax") -> Tensor:
    """Fate's host-side step: layer l+1's router weight ``[E, H]`` (fp32, on the host) applied to
    layer l's gate input ``[T, H]`` -> scores ``[T, E]``. The runtime and the simulator both call
    this, with the same shapes, so their predicted sets agree bit for bit."""
    x = gate_input.detach().to("cpu", torch.float32)  # (T, H) the gate input goes to the host
    return scores_from_logits(torch.nn.functional.linear(x, router_weight), scoring)  # (T, E)


def cross_layer_scores(gate_inputs: Tensor, router_weights: Sequence[Tensor], scoring: str = "softmax") -> Tensor:
    """Fate's cross-layer gate: scores for layer l+1 from layer l's gate input, ``[N, L-1, E]``."""
    N, L, H = gate_inputs.shape
    if len(router_weights) != L:
        raise ValueError(f"need one router weight [E, H] per MoE layer: got {len(router_weights)} for L={L}")
    logits = torch.stack(
        [gate_inputs[:, l].float() @ router_weights[l + 1].float().T for l in range(L - 1)], dim=1
    )  # (N, L-1, E)
    return scores_from_logits(logits, scoring)


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
        return [row[:k] for row, k in zip(order.tolist(), n)]  # the mask is always a prefix of the order


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


# ----------------------------------------------------------------------------- predictors


def _rank_union(rows: Sequence[Sequence[int]], scores: Tensor | None = None) -> list[int]:
    """Union of per-token id lists ordered by popularity count, then by the score summed over
    the tokens that picked the id, then by first position, then by id."""
    sl = None if scores is None else scores.reshape(len(rows), -1).tolist()
    count: dict[int, int] = {}
    summed: dict[int, float] = {}
    first: dict[int, int] = {}
    for t, r in enumerate(rows):
        for pos, e in enumerate(r):
            e = int(e)
            count[e] = count.get(e, 0) + 1
            summed[e] = summed.get(e, 0.0) + (sl[t][e] if sl is not None else 0.0)
            first.setdefault(e, pos)
    return sorted(count, key=lambda e: (-count[e], -summed[e], first[e], e))


def _rows(x: Tensor) -> list[list[int]]:
    """A LongTensor ``[k]`` or ``[T, k]`` as a list of id rows."""
    x = torch.as_tensor(x)
    return [x.tolist()] if x.dim() == 1 else x.tolist()


class Predictor:
    """Interface shared by the runtime and the replay (see the module docstring)."""

    name = "predictor"

    def reset(self) -> None:
        """Forget per-sequence state (called at the start of each prompt)."""

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:  # pragma: no cover
        """Experts predicted for MoE layer ``layer + 1``, most probable first.

        One decode token: ``next_scores [E]`` (or ``[1, E]``), ``cur_experts [k]``. A prefill
        batch: ``next_scores [T, E]``, ``cur_experts [T, k]``; the union is returned, ordered by
        how many tokens predicted each expert, then by summed score.
        """
        raise NotImplementedError

    def observe(self, layer: int, experts: Tensor) -> None:
        """True routing of ``layer`` for the current token(s), ``[k]`` or ``[T, k]``."""


class CrossLayerGate(Predictor):
    """Fate: apply a selection rule to the cross-layer gate scores of layer l+1."""

    def __init__(self, rule: SelectionRule):
        self.rule = rule
        self.name = f"fate[{rule}]"

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:
        if next_scores is None:
            raise ValueError("CrossLayerGate needs next_scores (layer l gate input x W[l+1] scores)")
        s = next_scores.reshape(-1, next_scores.shape[-1])  # (T, E)
        if s.shape[0] == 1:  # a decode token: the plain-Python path
            return self.rule.ids_row(s[0].tolist())
        return _rank_union(self.rule.ids(s), s)


class SameTokenPrevLayer(Predictor):
    """Predict layer l+1 = the experts this token used in layer l (expert ids are not aligned
    across layers, so this is a baseline, strong only where a model was trained to align them)."""

    name = "same_token_prev_layer"

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:
        return _rank_union(_rows(cur_experts))


class PrevTokenSameLayer(Predictor):
    """Predict layer l+1 = the experts the previous token used in layer l+1 (temporal locality)."""

    name = "prev_token_same_layer"

    def __init__(self):
        self._last: dict[int, list[list[int]]] = {}

    def reset(self) -> None:
        self._last = {}

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:
        rows = self._last.get(layer + 1)
        return [] if rows is None else _rank_union(rows[-1:])

    def observe(self, layer: int, experts: Tensor) -> None:
        self._last[layer] = _rows(experts)


class ActivationPath(Predictor):
    """Expert-activation-path predictor (the paper's "EAP" baseline), learned online.

    Keeps co-occurrence counts ``C[l][i][j]`` = tokens that used expert i in layer l and j in
    layer l+1. The score of j is ``sum_i C[l][i][j] / total_i`` over the token's layer-l experts
    i (ties by the marginal popularity of j in layer l+1); the ``n`` best are returned (``n``
    defaults to the number of current experts, k). ``history`` (``[N, L, k]``) pre-trains the
    counts from a profiling trace. ``reset`` keeps the learned counts (``forget`` drops them).
    """

    name = "activation_path"

    def __init__(self, n: int | None = None, history: Tensor | None = None):
        self.n = n
        self.forget()
        if history is not None:
            h = torch.as_tensor(history)
            for l in range(h.shape[1] - 1):
                self._learn(l, h[:, l].tolist(), h[:, l + 1].tolist())
                self._marg.setdefault(l + 1, Counter()).update(h[:, l + 1].reshape(-1).tolist())

    def forget(self) -> None:
        """Drop the learned statistics."""
        self._co: dict[int, dict[int, Counter]] = {}
        self._tot: dict[int, Counter] = {}
        self._marg: dict[int, Counter] = {}
        self._cur: dict[int, list[list[int]]] = {}

    def reset(self) -> None:
        self._cur = {}

    def _learn(self, layer: int, src_rows: list[list[int]], dst_rows: list[list[int]]) -> None:
        co = self._co.setdefault(layer, {})
        tot = self._tot.setdefault(layer, Counter())
        for src, dst in zip(src_rows, dst_rows):
            for i in src:
                co.setdefault(i, Counter()).update(dst)
                tot[i] += 1

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:
        rows = _rows(cur_experts)
        n = self.n if self.n is not None else len(rows[0])
        co, tot = self._co.get(layer, {}), self._tot.get(layer, Counter())
        marg = self._marg.get(layer + 1, Counter())
        preds = []
        for src in rows:
            score: dict[int, float] = {}
            for i in src:
                if i in co:
                    for j, c in co[i].items():
                        score[j] = score.get(j, 0.0) + c / tot[i]
            ranked = sorted(score, key=lambda j: (-score[j], -marg[j], j))
            if len(ranked) < n:  # too little history: fill with the most popular experts
                ranked += [j for j, _ in marg.most_common() if j not in score][: n - len(ranked)]
            preds.append(ranked[:n])
        return preds[0] if len(preds) == 1 else _rank_union(preds)

    def observe(self, layer: int, experts: Tensor) -> None:
        rows = _rows(experts)
        prev = self._cur.get(layer - 1)
        if prev is not None and len(prev) == len(rows):
            self._learn(layer - 1, prev, rows)
        self._marg.setdefault(layer, Counter()).update(e for r in rows for e in r)
        self._cur[layer] = rows


class RandomPredictor(Predictor):
    """``n`` experts drawn uniformly at random (a floor for the other predictors)."""

    def __init__(self, n: int, num_experts: int, seed: int = 0):
        self.n, self.num_experts, self.seed = n, num_experts, seed
        self.name = f"random[{n}]"
        self._rng = random.Random(seed)

    def reset(self) -> None:
        """Keeps the random stream running (each prompt gets fresh draws)."""

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:
        return self._rng.sample(range(self.num_experts), min(self.n, self.num_experts))


class Oracle(Predictor):
    """Predicts exactly the true experts of layer l+1 (replay only: reads the trace ahead).

    Keeps a token cursor over ``experts [N, L, k]``: it advances by the number of rows passed
    to ``observe`` of the last layer, so the driver must observe every token's last layer.
    """

    name = "oracle"

    def __init__(self, experts: Tensor):
        self._experts = torch.as_tensor(experts).tolist()
        self._L = len(self._experts[0]) if self._experts else 0
        self._t = 0

    def reset(self) -> None:
        """Keeps the cursor (prompts follow each other in the trace)."""

    def rewind(self) -> None:
        """Move the cursor back to the first token of the trace."""
        self._t = 0

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:
        T = len(_rows(cur_experts))
        return _rank_union([tok[layer + 1] for tok in self._experts[self._t : self._t + T]])

    def observe(self, layer: int, experts: Tensor) -> None:
        if layer == self._L - 1:
            self._t += len(_rows(experts))


# ----------------------------------------------------------------------------- evaluation


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
        for l, (r, p, s) in enumerate(zip(mean(recall, 0), mean(precision, 0), mean(size, 0)))
    ]
    return {
        "tokens": n,
        "recall": float(mean(recall)),
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
    overall numbers are means over (token, layer) pairs.
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
