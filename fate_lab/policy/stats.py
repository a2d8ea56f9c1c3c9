"""Counters of a run: per MoE layer and phase, plus a timeline of events -- one type for every driver.

What it is: plain dataclasses that the runtime, the timed simulator and the replay all fill (hits, late
prefetches, misses, prefetch recall/precision, bytes moved, stall time), their derived metrics with the
definitions of docs/DESIGN.md (hit rate = uses found resident when needed; prefill and decode apart), the
timing a driver recorded per forward (measured or simulated) and the speeds derived from it.
What it is not: a driver; the cache (`cache.py`) counts uses, the drivers count bytes and time.
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
    filled: int = 0  # background loads of host-computed misses into the cache (host_fill)
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
class RunStats:
    """Per MoE layer and phase counters, a timeline of events, the forwards' times and the setup behind them.

    The one result type of the runtime (measured), the timed simulator (predicted) and the replay (no
    clock: no forward times, so no speeds). `row()` is the one table row every table is made of.
    """

    layers: list[dict[str, PhaseStats]]
    link: str  # description of the link profile used
    store: str
    plan: MemoryPlan | None  # None: a replay given slots per layer directly
    slots_per_layer: list[int]
    driver: str = "runtime"  # "runtime" | "simulator" | "replay"
    expert_bytes: int = 0  # one expert at full precision (the unit of "experts moved")
    timeline: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    forward_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    moved: Counter = field(default_factory=Counter)  # (phase, layer, precision label) -> landed transfers

    def reset(self) -> None:
        """Zero every counter, the timeline and the forward times (the setup fields stay)."""
        self.layers = [{p: PhaseStats() for p in PHASES} for _ in self.layers]
        self.timeline = []
        self.forward_s = {p: [] for p in PHASES}
        self.moved = Counter()

    def total(self, phase: str) -> PhaseStats:
        """Counters of one phase summed over layers."""
        out = PhaseStats()
        for layer in self.layers:
            out.add(layer[phase])
        return out

    @property
    def ttft_s(self) -> float:
        """Mean time of a prefill forward (time to first token); NaN without prefill forwards."""
        pre = self.forward_s["prefill"]
        return sum(pre) / len(pre) if pre else float("nan")

    @property
    def decode_tok_s(self) -> float:
        """Decode forwards per second of decode forward time; NaN without timed decode forwards."""
        dec = self.forward_s["decode"]
        return len(dec) / sum(dec) if dec and sum(dec) > 0 else float("nan")

    def hit_rate(self, phase: str | None = "decode") -> float:
        """Uses found resident in `phase` ("prefill", "decode"; None: both), over all layers."""
        tot = PhaseStats()
        for p in PHASES if phase is None else (phase,):
            tot.add(self.total(p))
        return tot.hit_rate

    @staticmethod
    def _counts(per_phase: dict[str, PhaseStats]) -> dict:
        """Both phases of some counters as one plain dict (rates None where nothing was used)."""
        p, d = per_phase["prefill"], per_phase["decode"]
        both = PhaseStats()
        both.add(p)
        both.add(d)

        def rate(s: PhaseStats) -> float | None:
            return s.hits / s.uses if s.uses else None

        return {"uses": both.uses, "hits": both.hits, "misses": both.misses, "hit_rate": rate(both),
                "uses_prefill": p.uses, "hits_prefill": p.hits, "hit_rate_prefill": rate(p),
                "uses_decode": d.uses, "hits_decode": d.hits, "hit_rate_decode": rate(d),
                "demand_loads": both.misses - both.host - both.dropped - both.substituted,
                "prefetch_loads": both.prefetch_issued, "prefetch_useful": both.prefetch_useful,
                "prefetch_wasted": both.prefetch_wasted, "bytes_moved": both.bytes_moved}

    @property
    def overall(self) -> dict:
        """Counters of every layer and both phases: uses, hits, misses, hit rates (all / prefill / decode; None
        where nothing was used), demand and prefetch loads, prefetches useful and wasted, bytes moved."""
        return self._counts({ph: self.total(ph) for ph in PHASES})

    @property
    def per_layer(self) -> list[dict]:
        """`overall`'s counters for each MoE layer, with its index and cache slots."""
        return [{"layer": m, "slots": self.slots_per_layer[m], **self._counts(layer)}
                for m, layer in enumerate(self.layers)]

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
        """Per phase totals with hit rate, recall, precision, set size, stall and bytes (speeds: `ttft_s`,
        `decode_tok_s`)."""
        out: dict = {}
        for phase in PHASES:
            s = self.total(phase)
            out[phase] = {**dataclasses.asdict(s), **{k: getattr(s, k) for k in _DERIVED},
                          "forwards": len(self.forward_s[phase]), "forward_s": sum(self.forward_s[phase])}
        return out

    def row(self, name: str = "") -> dict:
        """The one table row (`ROW_COLUMNS`) of a run: speed, hit rates, stall, bytes, prediction quality."""
        d, p = self.total("decode"), self.total("prefill")
        n = max(1, len(self.forward_s["decode"])) if self.driver != "replay" else \
            max(1, d.calls // max(1, len(self.layers)))
        return {
            "config": name, "driver": self.driver, "slots": sum(self.slots_per_layer),
            "decode tok/s": self.decode_tok_s, "TTFT (ms)": 1e3 * self.ttft_s,
            "decode hit rate": d.hit_rate, "prefill hit rate": p.hit_rate,
            "stall (ms/token)": 1e3 * d.stall_s / n,
            "MiB moved per token": d.bytes_moved / n / 2**20,
            "experts moved per token": d.bytes_moved / self.expert_bytes / n if self.expert_bytes else float("nan"),
            "prefetch recall": d.recall, "prefetch precision": d.precision, "predicted set": d.set_size,
            "host calls per token": d.host / n,
        }


# the columns every run table shares (decode per token)
ROW_COLUMNS = tuple(RunStats([], "", "", None, []).row().keys())
