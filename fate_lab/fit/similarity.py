"""Computing the expert similarity table offline, and checking its definition on held-out tokens.

What this file is: `compute_similarity` runs every expert of every MoE layer on calibration tokens --
the gate inputs of a recorded trace, i.e. the very hidden states the router sees -- and measures how
much the output changes if expert f computes in place of expert e (the definition is in
`fate_lab/policy/similarity.py`); `weight_similarity` is the weight-space cosine baseline
(`sklearn.metrics.pairwise.cosine_similarity`, one call over [E, 3*I*H] rows, safe for zero rows);
`comparison_table` measures which definition predicts the real substitution error on disjoint (eval)
tokens. The command line is `python -m fate_lab fit-similarity --model DIR` (`fate_lab/cli.py`).
What it is not: the table as data and the substitution policies (`fate_lab/policy/similarity.py`).
Letters: M MoE layers, E experts, N calibration tokens, H hidden, I expert intermediate, k top-k.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fate_lab.model.adapters import adapt
from fate_lab.model.trace import Trace
from fate_lab.policy.similarity import FLOOR, MAX_TOKENS, ExpertSimilarity

_CHUNK = 512  # tokens per chunk: bounds the [E, chunk, H] outputs held at once


@torch.no_grad()
def expert_outputs(model: nn.Module, m: int, x: torch.Tensor) -> torch.Tensor:
    """Unweighted outputs [E, N, H] (float32) of every expert of MoE layer m on gate inputs x [N, H]."""
    experts = adapt(model).experts_module(m)
    x = x.to(experts.gate_up_proj.device, torch.float32)  # (N, H)
    out = []
    for e in range(experts.gate_up_proj.shape[0]):
        gate_up = experts.gate_up_proj[e].float()  # (2I, H)
        h = experts._apply_gate(F.linear(x, gate_up))  # (N, I) the family's own gating, as the runtime applies it
        out.append(F.linear(h, experts.down_proj[e].float()))  # (N, H)
    return torch.stack(out)  # (E, N, H)


def _calibration_rows(trace: Trace, max_tokens: int) -> torch.Tensor:
    """Row indices of the trace to use: all, or max_tokens evenly spaced ones (deterministic)."""
    n = trace.num_tokens
    if n <= max_tokens:
        return torch.arange(n)
    return torch.linspace(0, n - 1, max_tokens).round().long()  # (max_tokens,)


@torch.no_grad()
def output_moments(model: nn.Module, trace: Trace, max_tokens: int = MAX_TOKENS, floor: float = FLOOR,
                   progress: bool = True) -> dict[str, torch.Tensor]:
    """Token-weighted sums of the experts' outputs over a trace, per MoE layer (float64).

    "own" [M, E]: sum_t w_e(t) ||y_e||^2; "other" [M, E, E]: sum_t w_e(t) ||y_f||^2; "diff" [M, E, E]:
    sum_t w_e(t) ||y_f - y_e||^2 (exact differences: an identical expert gives exactly 0); "routed"
    [M, E]: tokens routed to e. Every error and scale below is a function of these.
    """
    if trace.gate_inputs is None:
        raise ValueError("this trace has no gate inputs (e.g. it came from a routing array); record one with "
                         "fate_lab.record_trace or lab.get_trace(split='calib') to compute expert similarity")
    ad = adapt(model)
    M, E = ad.num_moe_layers, ad.num_experts
    if (trace.num_layers, trace.num_experts) != (M, E):
        raise ValueError(f"the trace has {trace.num_layers} MoE layers x {trace.num_experts} experts but the model "
                         f"{M} x {E}; record the trace with this model")
    if max_tokens < 1 or floor < 0:
        raise ValueError(f"need max_tokens >= 1 and floor >= 0, got max_tokens={max_tokens}, floor={floor}")
    rows = _calibration_rows(trace, max_tokens)  # (N,)
    # gate inputs at fp16, as the trace file stores them: a fresh and a reloaded trace give the same numbers
    gate_inputs = trace.gate_inputs[rows].to(torch.float16).float()  # (N, M, H)
    experts = trace.experts[rows].long()  # (N, M, k)
    out = {"own": torch.zeros(M, E, dtype=torch.float64), "other": torch.zeros(M, E, E, dtype=torch.float64),
           "diff": torch.zeros(M, E, E, dtype=torch.float64), "routed": torch.zeros(M, E, dtype=torch.int64)}
    for m in tqdm(range(M), desc="expert outputs", unit="layer", disable=not progress):
        hit = torch.zeros(len(rows), E).scatter_(1, experts[:, m], 1.0)  # (N, E) 1 where t was routed to e
        out["routed"][m] = hit.sum(0).long()
        weight = (hit + floor).double()  # (N, E) w_e(t)
        for lo in range(0, len(rows), _CHUNK):
            y = expert_outputs(model, m, gate_inputs[lo:lo + _CHUNK, m]).cpu().transpose(0, 1)  # (n, E, H)
            w = weight[lo:lo + _CHUNK]  # (n, E)
            d2 = torch.cdist(y, y, compute_mode="donot_use_mm_for_euclid_dist").square().double()  # (n, E, E)
            norm2 = y.double().square().sum(-1)  # (n, E) ||y_e(t)||^2
            out["own"][m] += (norm2 * w).sum(0)  # (E,)
            out["other"][m] += w.T @ norm2  # (E, E) [e, f] = sum_t w_e(t) ||y_f(t)||^2
            out["diff"][m] += torch.einsum("nef,ne->ef", d2, w)  # (E, E)
    return out


def relative_error(moments: dict[str, torch.Tensor], scale: torch.Tensor | None = None) -> torch.Tensor:
    """Relative output error [M, E, E] of y_f (or of scale[m, e, f] * y_f) standing in for y_e."""
    own = moments["own"].clamp_min(1e-30)[..., None]  # (M, E, 1)
    if scale is None:
        return (moments["diff"] / own).sqrt().float()  # (M, E, E)
    s = scale.double()  # (M, E, E)
    cross = (moments["own"][..., None] + moments["other"] - moments["diff"]) / 2  # (M, E, E) sum_t w_e <y_e, y_f>
    return ((own - 2 * s * cross + s * s * moments["other"]) / own).clamp_min(0).sqrt().float()


def least_squares_scale(moments: dict[str, torch.Tensor]) -> torch.Tensor:
    """The factor [M, E, E] that makes scale * y_f closest to y_e on e's tokens (<y_e, y_f> / ||y_f||^2)."""
    cross = (moments["own"][..., None] + moments["other"] - moments["diff"]) / 2  # (M, E, E)
    return (cross / moments["other"].clamp_min(1e-30)).float()


def compute_similarity(model: nn.Module, trace: Trace, max_tokens: int = MAX_TOKENS, floor: float = FLOOR,
                       progress: bool = True) -> ExpertSimilarity:
    """Expert similarity of every MoE layer from the experts' outputs on a calibration trace."""
    moments = output_moments(model, trace, max_tokens, floor, progress)
    ad = adapt(model)
    meta = {
        "definition": "sim[m,e,f] = 1 - sqrt(sum_t w_e(t)||y_f(t)-y_e(t)||^2 / sum_t w_e(t)||y_e(t)||^2), "
                      "w_e(t) = [t routed to e] + floor; y = unweighted expert output on the router's input; "
                      "scale[m,e,f] = least-squares factor of y_f towards y_e on the same weights",
        "family": ad.family, "model": str(getattr(model.config, "_name_or_path", "")),
        "moe_layers": list(ad.moe_layers), "tokens": int(min(trace.num_tokens, max_tokens)),
        "trace_tokens": trace.num_tokens, "floor": floor,
    }
    return ExpertSimilarity(sim=1.0 - relative_error(moments), routed=moments["routed"], meta=meta,
                            scale=least_squares_scale(moments))


@torch.no_grad()
def weight_similarity(model: nn.Module) -> torch.Tensor:
    """Cosine of the experts' flattened (gate, up, down) weights [M, E, E]: the weight-space baseline."""
    from sklearn.metrics.pairwise import cosine_similarity

    ad = adapt(model)
    out = []
    for m in range(ad.num_moe_layers):
        ex = ad.experts_module(m)
        flat = torch.cat([ex.gate_up_proj.flatten(1), ex.down_proj.flatten(1)], dim=1)  # (E, 3*I*H)
        out.append(torch.from_numpy(cosine_similarity(flat.detach().float().cpu().numpy())).float())  # (E, E)
    return torch.stack(out)  # (M, E, E)


# --- which definition predicts the real error --------------------------------------------
def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 0..n-1 along the last dim (ties broken by position)."""
    return torch.argsort(torch.argsort(x, dim=-1), dim=-1).double()


def _row_spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of the Spearman rank correlation of a [R, n] and b [R, n]."""
    ra, rb = _ranks(a), _ranks(b)  # (R, n)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    return float(((ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1)).clamp_min(1e-30)).mean())


def compare_predictors(predictors: dict[str, torch.Tensor], true_err: torch.Tensor) -> list[dict]:
    """Per layer: the true error of each predictor's nearest expert, random and oracle, and rank correlations.

    predictors: name -> similarity [M, E, E] (larger = more similar); true_err: [M, E, E] measured on
    other tokens. "random" is the mean error over all f != e (the expectation of a random resident);
    "oracle" the smallest true error. Rank correlation: Spearman of similarity vs -error within each
    row e over f != e, averaged over e. Pure: tensors in, rows out.
    """
    M, E, _ = true_err.shape
    off = ~torch.eye(E, dtype=torch.bool)  # (E, E) f != e
    rows = []
    for m in range(M):
        err = true_err[m][off].view(E, E - 1)  # (E, E-1)
        row = {"layer": m, "random": float(err.mean()), "oracle": float(err.min(-1).values.mean())}
        for name, s in predictors.items():
            s_m = s[m][off].view(E, E - 1)  # (E, E-1)
            pick = torch.argmax(s_m, dim=-1, keepdim=True)  # (E, 1) first maximum: lowest id among ties
            row[f"nearest by {name}"] = float(err.gather(1, pick).mean())
            row[f"rank corr {name}"] = _row_spearman(s_m.double(), -err.double())
        rows.append(row)
    keys = [k for k in rows[0] if k != "layer"]
    rows.append({"layer": "mean", **{k: sum(r[k] for r in rows) / M for k in keys}})
    return rows


def comparison_table(model: nn.Module, sim: ExpertSimilarity, eval_trace: Trace, max_tokens: int = MAX_TOKENS,
                     progress: bool = True) -> list[dict]:
    """Output similarity vs weight cosine as predictors of the output error measured on eval_trace.

    Adds "nearest by outputs, scaled": the same pick as "nearest by outputs", its output multiplied
    by the calibration's least-squares `scale`, error measured on eval_trace.
    """
    moments = output_moments(model, eval_trace, max_tokens, float(sim.meta.get("floor", FLOOR)), progress)
    rows = compare_predictors({"outputs": sim.sim, "weights": weight_similarity(model)}, relative_error(moments))
    scaled = compare_predictors({"outputs": sim.sim}, relative_error(moments, sim.scale))
    for row, s in zip(rows, scaled, strict=False):
        row["nearest by outputs, scaled"] = s["nearest by outputs"]
    return rows
