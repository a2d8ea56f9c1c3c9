"""Expert predictors: "which experts will MoE layer l+1 need?" -- the objects every driver shares.

What this file is: ``Predictor`` subclasses: ``predict(layer, next_scores, cur_experts)`` returns the ids
predicted for layer ``layer+1``, most probable first; ``observe(layer, experts)`` feeds the true routing of
``layer``; ``scores(layer, gate_input, router)`` is the hook that says what the predictor reads for
layer+1 from layer's gate input (None for history predictors); ``set_phase`` tells it prefill or decode.
Fate's ``CrossLayerGate`` applies a selection rule (``rules.py``) to layer l+1's router on layer l's gate
input; ``ActivationPath`` (token-level layer-to-layer affinity, learned online) and ``ActivationMatrix``
(MoE-Infinity's request-level activation matrix) are the "expert activation path" baselines; the rest are
baselines and bounds.
What it is not: the rules (``rules.py``) or the metrics (``prediction_metrics.py``). No device, no
thread, no model here.
"""
from __future__ import annotations

import random
from collections import Counter
from typing import Sequence

import torch
from torch import Tensor

from fate_lab.policy.rules import RouterScores, SelectionRule


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
    """Interface shared by the runtime, the simulator and the replay (see the module docstring)."""

    name = "predictor"

    def reset(self) -> None:
        """Forget per-sequence state (called at the start of each prompt)."""

    def set_phase(self, phase: str) -> None:
        """The forward about to run is a "prefill" or a "decode" step (a predictor may keep one rule per phase)."""

    def scores(self, layer: int, gate_input: Tensor, router: RouterScores) -> Tensor | None:
        """What this predictor reads for layer ``layer + 1`` from layer ``layer``'s gate input ``[T, H]``:
        scores ``[T, E]``, or None (a history predictor reads no scores)."""
        return None

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:  # pragma: no cover
        """Experts predicted for MoE layer ``layer + 1``, most probable first.

        One decode token: ``next_scores [E]`` (or ``[1, E]``), ``cur_experts [k]``. A prefill
        batch: ``next_scores [T, E]``, ``cur_experts [T, k]``; the union is returned, ordered by
        how many tokens predicted each expert, then by summed score.
        """
        raise NotImplementedError

    def observe(self, layer: int, experts: Tensor) -> None:
        """True routing of ``layer`` for the current token(s), ``[k]`` or ``[T, k]``."""

    def predict_ahead(self, layer: int, gate_input: Tensor, router: RouterScores, distance: int) -> list[int] | None:
        """Experts predicted for MoE layer ``layer + distance`` of ONE decode token from layer ``layer``'s gate
        input ``[1, H]``, most probable first; None: this predictor sees one layer ahead only."""
        return None


class CrossLayerGate(Predictor):
    """Fate: apply a selection rule to the cross-layer gate scores of layer l+1."""

    def __init__(self, rule: SelectionRule):
        self.rule = rule
        self.name = f"fate[{rule}]"

    def scores(self, layer: int, gate_input: Tensor, router: RouterScores) -> Tensor:
        """Layer ``layer + 1``'s router applied on the host to layer ``layer``'s gate input: ``[T, E]``."""
        return router.scores(layer + 1, gate_input)

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:
        if next_scores is None:
            raise ValueError("CrossLayerGate needs next_scores (layer l gate input x W[l+1] scores)")
        s = next_scores.reshape(-1, next_scores.shape[-1])  # (T, E)
        if s.shape[0] == 1:  # a decode token: the plain-Python path
            return self.rule.ids_row(s[0].tolist())
        return _rank_union(self.rule.ids(s), s)

    def predict_ahead(self, layer: int, gate_input: Tensor, router: RouterScores, distance: int) -> list[int] | None:
        """Layer ``layer + distance``'s router applied to layer ``layer``'s gate input, through the same rule."""
        if layer + distance >= len(router):
            return None
        return self.rule.ids_row(router.scores(layer + distance, gate_input)[0].tolist())  # (E,) one token


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
        for src, dst in zip(src_rows, dst_rows, strict=False):
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


class ActivationMatrix(Predictor):
    """MoE-Infinity's request-level expert activation matrix (EAM): the sequence-level "activation path" predictor.

    Keeps the current sequence's matrix ``cur[l, e]`` (tokens routed to expert e of layer l since its prompt
    began, prefill included) and a collection of the matrices of other sequences: ``collection`` ``[C, L, E]``
    (a profiling trace's, `activation_matrices`), and every finished sequence joins it when the next prompt
    starts (``capacity`` newest kept beyond the profiled ones). To predict layer l+1 it takes the collected
    matrix most similar to ``cur`` (mean over layers of the cosine of the row-normalised rows, as MoE-Infinity's
    tracer matches) and returns its ``n`` most used experts of layer l+1 (ties: the current sequence's own
    count, then id); with nothing collected yet, the current sequence's own counts of layer l+1. ``n`` defaults
    to the number of current experts (top-k). Unlike `ActivationPath` it reads no token's own path: what a
    request did so far, matched against whole requests seen before.
    """

    name = "activation_matrix"

    def __init__(self, num_layers: int, num_experts: int, n: int | None = None, collection: Tensor | None = None,
                 capacity: int = 64):
        self.L, self.E, self.n, self.capacity = num_layers, num_experts, n, capacity
        seed = torch.zeros(0, num_layers, num_experts) if collection is None else torch.as_tensor(collection).float()
        if seed.dim() != 3 or tuple(seed.shape[1:]) != (num_layers, num_experts):
            raise ValueError(f"collection must be [C, {num_layers}, {num_experts}], got {tuple(seed.shape)}")
        self._seed = seed
        self._online: list[Tensor] = []
        self._norm = self._normalised(seed)  # (C, L, E)
        self._cur = torch.zeros(num_layers, num_experts)

    @staticmethod
    def _normalised(m: Tensor) -> Tensor:
        """Rows scaled to unit length (zero rows stay zero): ``[..., L, E]``."""
        return m / m.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    def reset(self) -> None:
        """A new prompt: the finished sequence joins the collection."""
        if self._cur.sum() > 0:
            self._online = (self._online + [self._cur])[-self.capacity:]
            self._norm = self._normalised(torch.cat([self._seed, torch.stack(self._online)]))
        self._cur = torch.zeros(self.L, self.E)

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:
        rows = _rows(cur_experts)
        n = (self.n if self.n is not None else len(rows[0])) if len(rows) == 1 else self.E  # prefill: all seen
        own = self._cur[layer + 1]  # (E,)
        if self._norm.shape[0]:
            cur = self._normalised(self._cur)  # (L, E)
            best = int((self._norm * cur).sum(-1).mean(-1).argmax())  # (C,) -> the most similar matrix
            score = self._norm[best, layer + 1]
        else:
            score = own
        ids = sorted(range(self.E), key=lambda e: (-float(score[e]), -float(own[e]), e))
        return [e for e in ids[:n] if float(score[e]) > 0 or float(own[e]) > 0]

    def observe(self, layer: int, experts: Tensor) -> None:
        for r in _rows(experts):
            for e in r:
                self._cur[layer, int(e)] += 1


def activation_matrices(experts: Tensor, prompt_id: Tensor, num_experts: int) -> Tensor:
    """One expert activation matrix per prompt of a trace: ``experts [N, L, k]``, ``prompt_id [N]`` ->
    ``[C, L, E]`` counts (the profiling collection `ActivationMatrix` matches against)."""
    ex, pid = torch.as_tensor(experts), torch.as_tensor(prompt_id)
    out = []
    for p in pid.unique(sorted=True).tolist():
        rows = ex[pid == p]  # (n, L, k)
        m = torch.zeros(ex.shape[1], num_experts)
        m.scatter_add_(1, rows.permute(1, 0, 2).reshape(ex.shape[1], -1),
                       torch.ones(ex.shape[1], rows.numel() // ex.shape[1]))
        out.append(m)
    return torch.stack(out) if out else torch.zeros(0, ex.shape[1], num_experts)


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

    def predict(self, layer: int, next_scores: Tensor | None, cur_experts: Tensor) -> list[int]:
        T = len(_rows(cur_experts))
        return _rank_union([tok[layer + 1] for tok in self._experts[self._t : self._t + T]])

    def observe(self, layer: int, experts: Tensor) -> None:
        if layer == self._L - 1:
            self._t += len(_rows(experts))


