"""Routing statistics that say which predictor and which cache a model rewards: transitions, reuse, recall.

What it is: three table functions over a recorded trace, the evidence behind docs/fate_vs_eap.md:
- `transition_entropy(experts, E)`: per adjacent layer pair, the entropy of an expert of layer l+1 (bits),
  its conditional entropy given one expert of layer l (over the k x k (i, j) pairs of each token), and the
  mutual information between them -- what an expert-activation-path predictor can know at most from the
  current token's path, against the log2(E) of a uniform choice;
- `reuse_distance(experts, E, prompt_id)`: per layer, over decode tokens, how many tokens pass before a used
  expert is used again in the same prompt (the share reused by the next token, within 4 and 16 tokens, never
  again) -- what a cache (LRU) rewards;
- `predictor_recall(trace, shape)`: decode recall / precision / set size of the cross-layer gate (top-k), the
  token-level activation path and the request-level activation matrix at the same set size k;
- `summary(trace, shape, calibration)`: the three in one short table (means over layer pairs and layers), as
  notebook 05 shows it beside the decomposition.
What it is not: a simulator; speeds are `fate_lab.sim.simulate`'s.
"""
from __future__ import annotations

import math

import pandas as pd
import torch

from fate_lab.core.shape import ModelShape
from fate_lab.model.trace import DECODE, Trace


def _entropy(counts: torch.Tensor) -> float:
    """Entropy in bits of a count vector (or of the flattened counts of a matrix)."""
    p = counts.flatten().double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log2()).sum()) if p.numel() else 0.0


def transition_entropy(experts: torch.Tensor, num_experts: int) -> pd.DataFrame:
    """One row per layer pair l -> l+1: H(next), H(next | current), mutual information, all in bits."""
    ex = torch.as_tensor(experts)
    N, L, k = ex.shape
    rows = []
    for l in range(L - 1):
        pairs = torch.zeros(num_experts, num_experts, dtype=torch.float64)  # (current i, next j)
        i = ex[:, l].unsqueeze(2).expand(N, k, k).reshape(-1)
        j = ex[:, l + 1].unsqueeze(1).expand(N, k, k).reshape(-1)
        pairs.index_put_((i, j), torch.ones_like(i, dtype=torch.float64), accumulate=True)
        h_next = _entropy(pairs.sum(0))
        h_joint, h_cur = _entropy(pairs), _entropy(pairs.sum(1))
        h_cond = h_joint - h_cur
        rows.append({"layer": l, "next_layer": l + 1, "H(next) bits": h_next, "H(next | current) bits": h_cond,
                     "mutual information bits": h_next - h_cond,
                     "share of H(next) explained": (h_next - h_cond) / h_next if h_next > 0 else float("nan"),
                     "uniform bits": math.log2(num_experts)})
    return pd.DataFrame(rows)


def reuse_distance(experts: torch.Tensor, num_experts: int, prompt_id: torch.Tensor | None = None,
                   phase: torch.Tensor | None = None) -> pd.DataFrame:
    """One row per layer: shares of decode uses reused by the next token / within 4 / within 16 tokens of the same
    prompt, never again, and the median distance of the reused ones."""
    ex = torch.as_tensor(experts)
    N, L, _ = ex.shape
    pid = torch.zeros(N, dtype=torch.long) if prompt_id is None else torch.as_tensor(prompt_id)
    dec = torch.ones(N, dtype=torch.bool) if phase is None else torch.as_tensor(phase) == DECODE
    rows = []
    for l in range(L):
        dists, never = [], 0
        for p in pid.unique().tolist():
            toks = [ex[t, l].tolist() for t in range(N) if int(pid[t]) == p and bool(dec[t])]
            nxt: dict[int, int] = {}
            for t in range(len(toks) - 1, -1, -1):  # distance to the next use of each expert
                for e in toks[t]:
                    if e in nxt:
                        dists.append(nxt[e] - t)
                    else:
                        never += 1
                for e in toks[t]:
                    nxt[e] = t
        n = len(dists) + never
        d = torch.tensor(dists, dtype=torch.float64) if dists else torch.zeros(0, dtype=torch.float64)
        rows.append({"layer": l, "uses": n, "reused next token": float((d == 1).sum()) / max(1, n),
                     "reused within 4": float((d <= 4).sum()) / max(1, n),
                     "reused within 16": float((d <= 16).sum()) / max(1, n), "never again": never / max(1, n),
                     "median distance (reused)": float(d.median()) if d.numel() else float("nan")})
    return pd.DataFrame(rows)


def predictor_recall(trace: Trace, shape: ModelShape, calibration: Trace | None = None) -> pd.DataFrame:
    """Decode recall, precision and set size of the cross-layer gate (top-k), the activation path (online) and the
    activation matrix (online; and seeded with the calibration trace's requests when one is given)."""
    from fate_lab.model.trace import cross_layer_scores
    from fate_lab.policy.prediction_metrics import evaluate_predictor, evaluate_rule
    from fate_lab.policy.predictors import ActivationMatrix, ActivationPath, activation_matrices
    from fate_lab.policy.rules import TopK

    E, L, k = shape.num_experts, shape.num_moe_layers, shape.top_k
    out = {"cross-layer gate (top-k)": evaluate_rule(cross_layer_scores(trace), trace.experts, TopK(k), trace.phase),
           "activation path (token, online)": evaluate_predictor(ActivationPath(), trace.experts, phase=trace.phase,
                                                                 prompt_id=trace.prompt_id, num_experts=E),
           "activation matrix (request, online)": evaluate_predictor(ActivationMatrix(L, E), trace.experts,
                                                                     phase=trace.phase, prompt_id=trace.prompt_id,
                                                                     num_experts=E)}
    if calibration is not None:
        seed = activation_matrices(calibration.experts, calibration.prompt_id, E)
        out["activation matrix (request, calibration-seeded)"] = evaluate_predictor(
            ActivationMatrix(L, E, collection=seed), trace.experts, phase=trace.phase, prompt_id=trace.prompt_id,
            num_experts=E)
    return pd.DataFrame([{"predictor": n, "decode recall": r["decode"]["recall"],
                          "decode precision": r["decode"]["precision"], "set size": r["decode"]["mean_set_size"]}
                         for n, r in out.items()])


def summary(trace: Trace, shape: ModelShape, calibration: Trace | None = None, recall: bool = True) -> pd.DataFrame:
    """The routing statistics of one trace in one table, a row per statistic: entropies and mutual information
    in bits (`transition_entropy`, mean over layer pairs, all tokens), reuse shares (`reuse_distance`, decode
    uses, mean over layers) and each predictor's decode recall (`predictor_recall`; left out with recall=False,
    e.g. for a routing-only trace without gate inputs). Columns: "bits" and "share" (a fraction; recall rows:
    the recall); a row has one of them."""
    te = transition_entropy(trace.experts, shape.num_experts)
    rd = reuse_distance(trace.experts, shape.num_experts, trace.prompt_id, trace.phase)
    nan = float("nan")
    rows = [("H(next layer's expert), mean over layer pairs", te["H(next) bits"].mean(), nan),
            ("H(uniform choice of an expert)", math.log2(shape.num_experts), nan),
            ("H(next | one current expert)", te["H(next | current) bits"].mean(), nan),
            ("mutual information, current -> next layer", te["mutual information bits"].mean(),
             te["share of H(next) explained"].mean()),
            ("decode uses reused by the next token", nan, rd["reused next token"].mean()),
            ("decode uses reused within 4 tokens", nan, rd["reused within 4"].mean()),
            ("decode uses reused within 16 tokens", nan, rd["reused within 16"].mean()),
            ("decode uses never used again in the prompt", nan, rd["never again"].mean())]
    if recall:
        pr = predictor_recall(trace, shape, calibration)
        rows += [(f"decode recall at set size k: {p}", nan, r)
                 for p, r in zip(pr["predictor"], pr["decode recall"], strict=True)]
    return pd.DataFrame(rows, columns=["statistic", "bits", "share"]).set_index("statistic")
