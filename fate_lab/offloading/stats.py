"""Counters of the offloaded runtime: per MoE layer and phase, plus a timeline of events.

What it is: plain dataclasses the runtime fills while it runs (hits, late prefetches, misses,
prefetch recall/precision, bytes moved, stall time) and their derived metrics, with the
definitions of DESIGN.md (hit rate = uses found resident when needed; prefill and decode apart).
What it is not: the runtime (``runtime.py``) or a simulator (``replay.py``).
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from fate_lab.policy.planner import MemoryPlan

PHASES = ("prefill", "decode")


@dataclass
class PhaseStats:
    """Counters of one MoE layer in one phase (prefill or decode)."""

    calls: int = 0  # experts calls (forward passes through this layer)
    uses: int = 0  # distinct experts needed, summed over calls
    hits: int = 0  # valid in a slot when needed (cached or prefetched in time)
    late: int = 0  # prefetch still in flight when needed (waited for: stall)
    misses: int = 0  # neither: loaded on demand, computed on the host, dropped or substituted
    host: int = 0  # ... of the misses, computed on the host (no transfer)
    dropped: int = 0  # ... of the misses, not computed (lossy decode step; output renormalised)
    substituted: int = 0  # ... of the misses, a resident expert (or its resident INT2 copy) computed in their place
    prefetch_issued: int = 0  # transfers queued by the predictor for this layer
    prefetch_useful: int = 0  # ... whose expert this layer then used
    prefetch_wasted: int = 0  # ... not used (cancelled while queued, or moved for nothing)
    predicted: int = 0  # predicted-set sizes summed (incl. already-resident experts)
    predicted_used: int = 0  # |predicted ∩ used| summed
    true_used: int = 0  # |used| summed, over calls that had a prediction
    predictions: int = 0  # calls that had a prediction
    failures: int = 0  # failed transfers (reloaded synchronously)
    bytes_moved: int = 0  # host->device bytes for this layer
    stall_s: float = 0.0  # compute thread waiting for transfers / synchronous loads
    compute_s: float = 0.0  # wall time inside this layer's experts call
    host_s: float = 0.0  # ... of it, experts computing on the host

    @property
    def hit_rate(self) -> float:
        """hits / uses."""
        return self.hits / self.uses if self.uses else float("nan")

    @property
    def recall(self) -> float:
        """Prefetch recall: of the experts used, the fraction that were predicted."""
        return self.predicted_used / self.true_used if self.true_used else float("nan")

    @property
    def precision(self) -> float:
        """Of the predicted experts, the fraction used."""
        return self.predicted_used / self.predicted if self.predicted else float("nan")

    @property
    def set_size(self) -> float:
        """Mean predicted-set size."""
        return self.predicted / self.predictions if self.predictions else float("nan")

    def add(self, other: "PhaseStats") -> None:
        """Accumulate other into self."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


_DERIVED = ("hit_rate", "recall", "precision", "set_size")


@dataclass
class RuntimeStats:
    """Per MoE layer and phase counters, a timeline of events, and the setup that produced them."""

    layers: list[dict[str, PhaseStats]]
    link: str  # description of the link profile used
    store: str
    plan: MemoryPlan
    slots_per_layer: list[int]
    timeline: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    forward_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    moved: Counter = field(default_factory=Counter)  # (phase, layer, precision label) -> landed transfers

    def total(self, phase: str) -> PhaseStats:
        """Counters of one phase summed over layers."""
        out = PhaseStats()
        for layer in self.layers:
            out.add(layer[phase])
        return out

    def rows(self) -> list[dict]:
        """One plain dict per (layer, phase), derived metrics included (for pandas)."""
        out = []
        for m, layer in enumerate(self.layers):
            for phase, s in layer.items():
                row = {"layer": m, "phase": phase, "slots": self.slots_per_layer[m], **dataclasses.asdict(s)}
                row.update({k: getattr(s, k) for k in _DERIVED})
                out.append(row)
        return out

    def summary(self) -> dict[str, dict]:
        """Per phase totals with hit rate, recall, precision, set size, stall and bytes."""
        out = {}
        for phase in PHASES:
            s = self.total(phase)
            out[phase] = {**dataclasses.asdict(s), **{k: getattr(s, k) for k in _DERIVED},
                          "forwards": len(self.forward_s[phase]), "forward_s": sum(self.forward_s[phase])}
        return out
