"""What to do with a missed expert when a little quality may buy speed: load it, drop it, or stand another in.

What this file is: `MissPolicy`, the pure decision the layer step asks in a DECODE step for the
experts a token needs that are neither resident nor in flight (the misses). Three kinds:
- "drop" (the baseline): a miss whose share of the token's top-k gate weight is below `threshold`
  is not computed; the layer's output is renormalised over the experts kept.
- "substitute" (SMoE): such a miss is replaced by the most similar resident expert of the same
  layer (`similarity.ExpertSimilarity`, computed offline on calibration tokens), computed with the
  missed expert's gate weight; no resident candidate (or none similar enough, `min_similarity`):
  dropped.
- "commit" (CommitMoE): when the router is uncertain -- the top-k experts hold less than
  `threshold` of its probability mass -- the token commits to what is resident or already in
  flight (predicted); every other miss is dropped, so the step queues no fallback load. A certain
  router loads its misses as `fate` does.
- "standin" (HOBBIT): every expert also has a low-precision (INT2) copy resident on the device; a
  miss computes from it at once (`LOWP`), and only an expert that recurs -- missed again within
  `window` decode calls of its layer after a low-precision use -- is loaded at full precision.
Prefill steps are never changed (their misses are amortised over many tokens), nor are hits.
What it is not: no bytes move here and nothing is measured; the quality cost of each kind is
measured against the plain model in `study/quality.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

LOSSY_KINDS = ("drop", "substitute", "commit", "standin")
LOWP = -2  # the "stand-in" of a miss computed from its resident low-precision copy (kind "standin")


@dataclass(frozen=True, eq=False)
class MissPolicy:
    """A decode-step rule for misses (semantics in the module docstring)."""

    kind: str
    threshold: float  # drop/substitute: gate-weight share; commit: top-k probability mass
    similarity: object | None = None  # substitute: a similarity.ExpertSimilarity
    min_similarity: float | None = None  # substitute: below this the miss is dropped instead
    window: int = 4  # standin: a miss within this many decode calls of its last low-precision use loads
    _last: dict = field(default_factory=dict, repr=False)  # standin: (layer, expert) -> call of its last LOWP use
    _calls: dict = field(default_factory=dict, repr=False)  # standin: layer -> decode calls seen

    def __post_init__(self):
        if self.kind not in LOSSY_KINDS:
            raise ValueError(f"lossy policy {self.kind!r}; choose one of {list(LOSSY_KINDS)}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"lossy threshold must be in [0, 1], got {self.threshold}")
        if self.kind == "substitute" and self.similarity is None:
            raise ValueError("the substitute policy needs an expert similarity table (policy.similarity)")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"standin window must be a non-negative number of decode calls, got {self.window!r}")

    def plan(self, m: int, missing: list[int], share: dict[int, float], resident: Collection[int],
             topk_mass: float | None) -> dict[int, int | None]:
        """For the misses of layer m in one decode token: {e: stand-in expert} or {e: None} (dropped);
        misses not in the answer are loaded. share[e]: e's share of the token's top-k gate weight;
        topk_mass: the router's probability on its top-k (commit only)."""
        if self.kind == "standin":
            t = self._calls[m] = self._calls.get(m, 0) + 1
            out = {}
            for e in missing:
                last = self._last.get((m, e))
                if last is not None and t - last <= self.window:
                    del self._last[(m, e)]  # it recurs: load it at full precision (the cache may keep it)
                    continue
                out[e] = LOWP
                self._last[(m, e)] = t
            return out
        if self.kind == "commit":
            if topk_mass is None:
                raise ValueError("the commit policy needs the router's probabilities")
            return {e: None for e in missing} if topk_mass < self.threshold else {}
        out: dict[int, int | None] = {}
        for e in missing:
            if share[e] >= self.threshold:
                continue
            if self.kind == "drop":
                out[e] = None
            else:
                out[e] = self.similarity.substitute(m, e, resident, self.min_similarity)
        return out
