"""Which resident expert can stand in for a missing one: per-layer expert similarity, computed offline.

What this file is: the data behind expert *substitution* (on a miss of a low-weight expert,
compute the most similar resident expert of the same layer instead). `compute_similarity` runs
every expert of every MoE layer on calibration tokens -- the gate inputs of a recorded trace, i.e.
the very hidden states the router sees -- and measures how much the output changes if expert f
computes in place of expert e. The result, an `ExpertSimilarity` ([M, E, E], kept with the model
as `expert_similarity.safetensors` + `.json`), feeds two pure policies over plain tensors:
`substitute(sim, m, e, resident)` and `nearest(sim, m, e, k)`. `comparison_table` checks the
definition against weight-space cosine (`weight_similarity`) on disjoint (eval) tokens.

Definition (per MoE layer m, y_e(t) = expert e's unweighted output on token t):
    err[e, f] = sqrt( sum_t w_e(t) ||y_f(t) - y_e(t)||^2 / sum_t w_e(t) ||y_e(t)||^2 )
    sim[e, f] = 1 - err[e, f]
with w_e(t) = 1 if the router sent token t to e, plus a small floor on every token (so an expert
the calibration text rarely routes to still gets a defined, if blurrier, row). err is the
relative output error of computing f as-is with e's gate weight: 0 for an identical expert
(sim = 1, the maximum), 1 for computing nothing in e's place (dropping e, before any
renormalisation), so `min_similarity=0.0` in `substitute` means "only where that beats dropping".
sim is not symmetric: row e is weighted by e's tokens. `scale[e, f]` is the least-squares factor
that brings y_f closest to y_e on the same tokens; a policy that multiplies f's gate weight by it
is left with err = sqrt(1 - cos^2), cos the token-weighted cosine of the two outputs.

Why outputs, not weights: experts trained from separate initialisations differ by a permutation
of their hidden units, so the cosine of flattened weights says little about what a substitution
does to the output; `comparison_table` measures both on held-out tokens.

scikit-learn serves twice: `sklearn.metrics.pairwise.cosine_similarity` for the weight-space
baseline (one call over [E, 3*I*H] rows, safe for zero rows), and `AgglomerativeClustering` on a
precomputed distance (average linkage over the symmetrised err) in `expert_clusters`, to show
groups of interchangeable experts; both are standard, tested code we would otherwise re-write.

What it is not: no cache, no runtime hook. The substitution/commit policies that call
`substitute` live with the expert cache; nothing here touches a device at run time.
Letters: M MoE layers, E experts, N calibration tokens, H hidden, I expert intermediate, k top-k.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fate_lab.model.adapters import adapt
from fate_lab.model.trace import Trace
from fate_lab.paths import model_dir as _model_dir

SIMILARITY_FILE = "expert_similarity.safetensors"
FORMAT_VERSION = 1
FLOOR = 0.02  # token weight of a token NOT routed to e (a routed token weighs 1 + FLOOR)
MAX_TOKENS = 4096  # calibration tokens used by default (evenly spaced rows of the trace)
_CHUNK = 512  # tokens per chunk: bounds the [E, chunk, H] outputs held at once
_META_KEY = "fate_lab_expert_similarity"


# --- the data ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertSimilarity:
    """Per-layer expert similarity sim[m, e, f] = 1 - relative output error of f computing for e."""

    sim: torch.Tensor  # (M, E, E) float32; 1 on the diagonal, larger is more similar
    routed: torch.Tensor  # (M, E) int64 calibration tokens routed to each expert (how sharp row e is)
    meta: dict = field(default_factory=dict)  # definition, model, tokens, trace split, comparison table
    scale: torch.Tensor | None = None  # (M, E, E) least-squares factor: scale * y_f is closest to y_e

    def __post_init__(self) -> None:
        if self.sim.dim() != 3 or self.sim.shape[1] != self.sim.shape[2]:
            raise ValueError(f"ExpertSimilarity.sim must be [layers, experts, experts]; got {tuple(self.sim.shape)}")
        if tuple(self.routed.shape) != tuple(self.sim.shape[:2]):
            raise ValueError(f"ExpertSimilarity.routed must be [layers, experts] = {tuple(self.sim.shape[:2])}; "
                             f"got {tuple(self.routed.shape)}")
        if self.scale is not None and self.scale.shape != self.sim.shape:
            raise ValueError(f"ExpertSimilarity.scale must have sim's shape {tuple(self.sim.shape)}; "
                             f"got {tuple(self.scale.shape)}")

    @property
    def num_layers(self) -> int:
        """M, the MoE layers."""
        return self.sim.shape[0]

    @property
    def num_experts(self) -> int:
        """E, the routed experts per layer."""
        return self.sim.shape[1]

    @property
    def error(self) -> torch.Tensor:
        """Relative output error [M, E, E] of computing f in place of e (1 - sim)."""
        return 1.0 - self.sim

    def substitute(self, m: int, e: int, resident: Collection[int], min_similarity: float | None = None) -> int | None:
        """The resident expert of layer m most similar to e (see the module function `substitute`)."""
        return substitute(self.sim, m, e, resident, min_similarity)

    def nearest(self, m: int, e: int, k: int) -> list[int]:
        """The k experts of layer m most similar to e, most similar first (e itself excluded)."""
        return nearest(self.sim, m, e, k)

    def clusters(self, m: int, max_error: float = 0.9) -> list[list[int]]:
        """Groups of interchangeable experts of layer m (see `expert_clusters`)."""
        return expert_clusters(self.sim, m, max_error)

    def save(self, path: str | Path) -> Path:
        """Write `path` (.safetensors: sim, routed, metadata) and a readable `.json` beside it."""
        from safetensors.torch import save_file

        path = Path(path)
        if path.suffix != ".safetensors":
            raise ValueError(f"save an ExpertSimilarity to a .safetensors path, got {path}")
        meta = dict(self.meta, format_version=FORMAT_VERSION, num_moe_layers=self.num_layers,
                    num_experts=self.num_experts)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"similarity": self.sim.float().contiguous(), "routed_tokens": self.routed.long().contiguous()}
        if self.scale is not None:
            tensors["scale"] = self.scale.float().contiguous()
        save_file(tensors, str(path), metadata={_META_KEY: json.dumps(meta)})
        path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ExpertSimilarity":
        """Read a file written by `save` (safetensors + JSON metadata; no pickles)."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(_META_KEY)
            if raw is None or "similarity" not in f.keys():
                raise ValueError(f"{path} is a safetensors file but not a fate_lab expert similarity "
                                 f"(no {_META_KEY!r} metadata or no 'similarity' tensor)")
            sim, routed = f.get_tensor("similarity"), f.get_tensor("routed_tokens")
            scale = f.get_tensor("scale") if "scale" in f.keys() else None
        meta = json.loads(raw)
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path} has expert-similarity format {meta.get('format_version')!r}; this fate_lab "
                             f"reads {FORMAT_VERSION}. Recompute it: python -m fate_lab.policy.similarity --model DIR")
        return cls(sim=sim, routed=routed, meta=meta, scale=scale)


def similarity_path(model_dir: str | Path | None = None) -> Path:
    """Where a model folder keeps its expert similarity (None: the embedded tiny MoE)."""
    return _model_dir(model_dir) / SIMILARITY_FILE


def load_similarity(model_dir: str | Path | None = None) -> ExpertSimilarity:
    """The expert similarity kept with a model folder (None: the embedded tiny MoE)."""
    path = similarity_path(model_dir)
    if not path.exists():
        raise FileNotFoundError(
            f"no expert similarity for the model in {path.parent} (looked for {path.name}); compute it once with "
            f"`python -m fate_lab.policy.similarity --model {path.parent}` (it runs every expert on a "
            f"calibration trace; seconds for the tiny model)")
    return ExpertSimilarity.load(path)


# --- pure policies over plain tensors ---------------------------------------------------
def substitute(sim: torch.Tensor, m: int, e: int, resident: Collection[int],
               min_similarity: float | None = None) -> int | None:
    """The resident expert most similar to e in layer m (sim [M, E, E]); ties go to the lower id.

    e itself is returned when resident (nothing to substitute). None when nothing is resident, or
    when the best similarity is below `min_similarity` (e.g. 0.0: substitute only where that beats
    dropping e).
    """
    if e in resident:
        return e
    if not resident:
        return None
    candidates = sorted(int(f) for f in resident)  # ascending: argmax keeps the first (lowest) of equal maxima
    scores = sim[m, e, candidates]  # (R,)
    best = int(torch.argmax(scores))
    if min_similarity is not None and float(scores[best]) < min_similarity:
        return None
    return candidates[best]


def nearest(sim: torch.Tensor, m: int, e: int, k: int) -> list[int]:
    """The k experts of layer m most similar to e, most similar first, ties by lower id; e excluded."""
    row = sim[m, e].tolist()  # (E,)
    order = sorted((f for f in range(len(row)) if f != e), key=lambda f: (-row[f], f))
    return order[:k]


def expert_clusters(sim: torch.Tensor, m: int, max_error: float = 0.9) -> list[list[int]]:
    """Groups of experts of layer m whose average-linkage distance (err + err.T)/2 stays below max_error.

    Every expert is in exactly one group (most are alone when experts are specialised); groups and
    their members are sorted by id.
    """
    from sklearn.cluster import AgglomerativeClustering

    err = 1.0 - sim[m].double()  # (E, E)
    dist = ((err + err.T) / 2).clamp_min(0).fill_diagonal_(0).numpy()  # (E, E) symmetric, zero diagonal
    labels = AgglomerativeClustering(n_clusters=None, metric="precomputed", linkage="average",
                                     distance_threshold=max_error).fit_predict(dist)
    groups: dict[int, list[int]] = {}
    for e, c in enumerate(labels.tolist()):
        groups.setdefault(c, []).append(e)
    return sorted(groups.values())


# --- computing it -----------------------------------------------------------------------
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
    for row, s in zip(rows, scaled):
        row["nearest by outputs, scaled"] = s["nearest by outputs"]
    return rows


# --- command line -------------------------------------------------------------------------
def _print_table(rows: list[dict]) -> None:
    """Rows as a markdown table."""
    keys = list(rows[0])
    cell = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(cell(r[k]) for k in keys) + " |")


def main(argv: list[str] | None = None) -> None:
    """Compute a model's expert similarity on its calib trace, save it beside the model, print the check."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="embedded model name (tiny_moe, tiny_deepseek) or local HF MoE checkpoint folder (default: tiny_moe)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="calibration tokens (evenly spaced rows)")
    p.add_argument("--floor", type=float, default=FLOOR, help="weight of tokens not routed to the expert")
    p.add_argument("--out", default=None, help="output .safetensors (default: <model>/" + SIMILARITY_FILE + ")")
    p.add_argument("--no-check", action="store_true", help="skip the comparison on the eval trace")
    args = p.parse_args(argv)
    from fate_lab.study import lab  # the cached calib/eval traces of the notebooks

    torch.manual_seed(0)
    model, _ = lab.load(args.model)
    calib = lab.get_trace(args.model, split="calib")
    t0 = time.perf_counter()
    sim = compute_similarity(model, calib, args.max_tokens, args.floor)
    seconds = time.perf_counter() - t0  # printed, not stored: the file stays deterministic
    sim.meta.update(model=lab.model_path(args.model).name, trace="lab.get_trace(split='calib')",
                    groups_below_0_9=[[g for g in sim.clusters(m, 0.9) if len(g) > 1] for m in range(sim.num_layers)])
    print(f"expert similarity: {sim.num_layers} layers x {sim.num_experts} experts on {sim.meta['tokens']} "
          f"calibration tokens in {seconds:.1f} s")
    if not args.no_check:
        rows = comparison_table(model, sim, lab.get_trace(args.model, split="eval"), args.max_tokens)
        sim.meta["comparison_on_eval_trace"] = rows
        print("\nrelative output error of the substitute, measured on the eval trace (1.0 = as bad as dropping):\n")
        _print_table(rows)
    path = sim.save(args.out or similarity_path(lab.model_path(args.model)))
    print(f"\nwrote {path} and {path.with_suffix('.json').name}")


if __name__ == "__main__":
    main()
