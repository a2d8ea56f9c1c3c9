"""Which resident expert can stand in for a missing one: per-layer expert similarity, computed offline.

What this file is: the data behind expert *substitution* (on a miss of a low-weight expert,
compute the most similar resident expert of the same layer instead): an `ExpertSimilarity`
([M, E, E], kept with the model as `expert_similarity.safetensors` + `.json`) and the pure policies
over it, `substitute(sim, m, e, resident)`, `nearest(sim, m, e, k)` and `expert_clusters`. It is
computed offline by `fate_lab/fit/similarity.py` (`python -m fate_lab fit-similarity --model DIR`),
which runs every expert on calibration tokens and checks the definition on held-out ones.

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
does to the output; `fate_lab.fit.similarity.comparison_table` measures both on held-out tokens.

scikit-learn's `AgglomerativeClustering` on a precomputed distance (average linkage over the
symmetrised err) gives `expert_clusters`, groups of interchangeable experts: standard, tested code we
would otherwise re-write.
What it is not: no fitting, no model run, no cache, no runtime hook (the lossy miss rule that calls
`substitute` is `lossy.py`).
Letters: M MoE layers, E experts, N calibration tokens, H hidden, I expert intermediate, k top-k.
"""
from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fate_lab.paths import model_dir as _model_dir

FIT_COMMAND = "python -m fate_lab fit-similarity --model DIR"
SIMILARITY_FILE = "expert_similarity.safetensors"
FORMAT_VERSION = 1
FLOOR = 0.02  # token weight of a token NOT routed to e (a routed token weighs 1 + FLOOR)
MAX_TOKENS = 4096  # calibration tokens used by default (evenly spaced rows of the trace)
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
                             f"reads {FORMAT_VERSION}. Recompute it: {FIT_COMMAND}")
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
            f"`python -m fate_lab fit-similarity --model {path.parent}` (it runs every expert on a "
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
