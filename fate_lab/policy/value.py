"""Prefetch by value: which predicted experts are worth link time, in which order, at which precision.

What this file is: the pure arithmetic of the value planner that `value_cache.ValueCache` runs each layer:
- `LinkView`: what the planner knows of the link when layer m starts (seconds): one layer's compute (the
  window unit), the link work already committed, one prefetch at full / low precision, the stall of a miss
  and how likely the next layer is to wait on a demand load at all;
- `Candidate`: a predicted expert of layer m+d with its probability of use;
- `plan_prefetches(cands, view)`: the greedy plan. Candidates go most probable first (nearer layer first on
  ties); each is placed behind what is already queued, and kept only when its expected stall saved beats the
  delay it imposes on demand loads:

      start = backlog + link time of the prefetches kept before it;  finish = start + transfer
      gain  = p x max(0, miss_s - max(0, finish - d x layer_s))     (a late arrival saves only part)
      cost  = demand x max(0, finish - layer_s) if start < layer_s else 0, x (1 - p) when d == 1
              (a transfer still on the link when layer m+1 starts delays its demand loads by what is left
              of it: urgent loads jump queued prefetches, never a started one; a used m+1 prefetch is not a
              cost, a two-ahead one always is)

  With a low precision on offer (INT2 for an INT4 prefetch) the option of larger gain - cost is taken, the
  full one on ties. A candidate whose best net value is <= 0 is dropped and takes no link time;
- `RankOdds`: the probability that the expert at rank r of a distance-d prediction is used, learned online
  from the predictions' outcomes (Laplace-smoothed counts), so no table has to be fitted per model;
- `UseRate`: per-layer exponentially decayed use counts, the worth of a resident expert for admission
  (`worth_admitting`: evict only an expert worth less than the one coming in).
What it is not: the cache (`value_cache.py` moves nothing either, it asks the link) or a predictor.
No device, no thread, no clock here: every time is a number handed in.
"""
from __future__ import annotations

from dataclasses import dataclass

EPS = 1e-12


@dataclass(frozen=True)
class LinkView:
    """The link as the value planner sees it when layer m starts (all in seconds)."""

    layer_s: float  # one layer's compute: layer m+d starts about d x layer_s from now
    backlog_s: float  # link work queued or running ahead of a new non-urgent transfer
    prefetch_s: float  # one prefetch at its precision
    miss_s: float  # the stall a miss costs (a demand transfer, or the host call when that is cheaper)
    low_s: float | None = None  # one prefetch at the low precision; None: none on offer
    demand: float = 1.0  # probability that layer m+1 issues a demand load at all (the delay's weight)

    def __post_init__(self) -> None:
        for name in ("layer_s", "backlog_s", "prefetch_s", "miss_s", "demand"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and v == v and v != float("inf")):
                raise ValueError(f"LinkView.{name}={v!r}: give a finite number >= 0")
        if self.low_s is not None and not (0 <= self.low_s < float("inf")):
            raise ValueError(f"LinkView.low_s={self.low_s!r}: give a finite number >= 0 or None")


@dataclass(frozen=True)
class Candidate:
    """A predicted expert: `expert` of MoE layer `layer`, `distance` layers ahead, used with probability p."""

    layer: int
    expert: int
    distance: int
    p: float


@dataclass(frozen=True)
class Planned:
    """A prefetch the plan keeps: its candidate, precision, projected start/finish and expected gain/cost (s)."""

    layer: int
    expert: int
    low: bool
    start_s: float
    finish_s: float
    gain_s: float
    cost_s: float


def _net(c: Candidate, start: float, t: float, view: LinkView) -> tuple[float, float, float]:
    """(gain, cost, finish) of queueing candidate c at `start` for a transfer of t seconds."""
    finish = start + t
    late = max(0.0, finish - c.distance * view.layer_s)
    gain = c.p * max(0.0, view.miss_s - late)
    block = max(0.0, finish - view.layer_s) if start < view.layer_s else 0.0
    cost = view.demand * block * ((1.0 - c.p) if c.distance == 1 else 1.0)
    return gain, cost, finish


def plan_prefetches(cands: list[Candidate], view: LinkView) -> list[Planned]:
    """The prefetches worth their link time, in queue order (semantics in the module docstring)."""
    order = sorted(range(len(cands)), key=lambda i: (-cands[i].p, cands[i].distance, i))
    clock, out = view.backlog_s, []
    for i in order:
        c = cands[i]
        options = [(view.prefetch_s, False)]
        if view.low_s is not None and view.low_s < view.prefetch_s:
            options.append((view.low_s, True))
        best = None
        for t, low in options:
            gain, cost, finish = _net(c, clock, t, view)
            if best is None or gain - cost > best[0] - best[1] + EPS:
                best = (gain, cost, finish, low)
        gain, cost, finish, low = best
        if gain - cost <= EPS:
            continue
        out.append(Planned(c.layer, c.expert, low, clock, finish, gain, cost))
        clock = finish
    return out


class RankOdds:
    """P(the expert at rank r of a distance-d prediction is used), from counted outcomes (Laplace prior)."""

    def __init__(self, prior: float = 0.5, weight: float = 2.0):
        if not 0.0 <= prior <= 1.0 or weight <= 0:
            raise ValueError(f"RankOdds(prior={prior}, weight={weight}): need 0 <= prior <= 1 and weight > 0")
        self.prior, self.weight = prior, weight
        self.seen: dict[tuple[int, int], int] = {}
        self.used: dict[tuple[int, int], int] = {}

    def p(self, distance: int, rank: int) -> float:
        """The smoothed probability of use at (distance, rank)."""
        key = (distance, rank)
        return (self.used.get(key, 0) + self.prior * self.weight) / (self.seen.get(key, 0) + self.weight)

    def record(self, distance: int, rank: int, used: bool) -> None:
        """One prediction's outcome at (distance, rank)."""
        key = (distance, rank)
        self.seen[key] = self.seen.get(key, 0) + 1
        if used:
            self.used[key] = self.used.get(key, 0) + 1


class UseRate:
    """Exponentially decayed use counts per expert of one layer: +1 per call that uses it, x decay per call."""

    def __init__(self, decay: float = 0.9):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"UseRate(decay={decay}): give 0 < decay <= 1")
        self.decay = decay
        self.calls = 0
        self._v: dict[int, tuple[float, int]] = {}  # expert -> (value, call index it is valid at)

    def rate(self, e: int) -> float:
        """The decayed count of expert e now."""
        v, at = self._v.get(e, (0.0, self.calls))
        return v * self.decay ** (self.calls - at)

    def call(self, used: list[int]) -> None:
        """One call of the layer that used `used`."""
        self.calls += 1
        for e in used:
            self._v[e] = (self.rate(e) + 1.0, self.calls)


def worth_admitting(rate_in: float, rate_victim: float | None) -> bool:
    """Admit an expert used at rate_in in place of a victim used at rate_victim (None: a free slot)?"""
    return rate_victim is None or rate_in > rate_victim + EPS


def would_evict(resident_order: list[int], protect) -> int | None:
    """The first resident id, in the policy's eviction order, that is not protected (None: none)."""
    return next((e for e in resident_order if e not in protect), None)
