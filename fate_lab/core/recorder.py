"""What a driver records while it runs: `Recorder`, the one place the runtime, the simulator and the replay write to.

What this file is: the stats every driver returns (`policy/stats.RunStats`), the timeline of (kind, layer, expert,
start, end) events, stall time, the phase of the forward running now, and the per-phase layer-time estimate (an EMA
over forwards, stall excluded) that sizes the prefetch window. A link (real engine, simulated, instant) is handed
the recorder and the driver core's precision rule (`DriverCore.spec`), and nothing else of its driver.
What it is not: what a driver builds from its config (plan, slots, precision, predictor, placement, cache: the
driver core, `driver.py`). It reads no clock: every time is handed in.
"""
from __future__ import annotations

from fate_lab.core.config_parts import TimelineConfig
from fate_lab.policy.stats import PHASES, RunStats
from fate_lab.quant import QuantSpec

STALL_MIN_S = 2e-5  # a wait shorter than this is bookkeeping, not a stall
WINDOW_EMA = 0.3  # weight of the newest forward in the per-phase layer-time estimate (prefetch window)


def spec_label(spec: QuantSpec | None) -> str:
    """A short name of a transfer precision for counters: 'fp', 'int4/g64', ..."""
    return "fp" if spec is None else f"int{spec.bits}/g{spec.group_size}" + ("/hqq" if spec.refine else "")


class Recorder:
    """The counters, timeline, stall and layer-time estimate of one driver; see the module docstring."""

    def __init__(self, stats: RunStats, num_layers: int, timeline: TimelineConfig, prefetch_window: float):
        """stats: the driver's `RunStats` (reset in place, never replaced); num_layers: decoder layers per forward
        (the layer-time estimate divides a forward by it); prefetch_window: layer times a prefetch may start ahead."""
        self.stats, self.num_layers = stats, num_layers
        self.timeline_on, self.max_events = timeline.on, timeline.max_events
        self.prefetch_window = prefetch_window
        self.phase = "prefill"  # the forward running now
        self.window_s: dict[str, float] = {}  # per phase: EMA of one layer's compute time (no stall)
        self.t_origin = 0.0  # timeline times are relative to this
        self._stall_in_forward = 0.0

    def landed(self, m: int, nbytes: int, spec: QuantSpec | None) -> None:
        """Count a landed transfer's bytes and precision."""
        self.stats.layers[m][self.phase].bytes_moved += nbytes
        self.stats.moved[self.phase, m, spec_label(spec)] += 1

    def event(self, kind: str, m: int, e: int, t0: float, t1: float) -> None:
        """Append (kind, layer, expert, start, end) to the timeline (relative to `t_origin`)."""
        tl = self.stats.timeline
        if self.timeline_on and len(tl) < self.max_events:
            tl.append((kind, m, e, t0 - self.t_origin, t1 - self.t_origin))

    def stall(self, m: int, e: int, w0: float, w1: float) -> None:
        """Count a wait of the compute thread for (m, e) from w0 to w1 as stall, if it was one."""
        if w1 - w0 > STALL_MIN_S:
            self.stats.layers[m][self.phase].stall_s += w1 - w0
            self._stall_in_forward += w1 - w0
            self.event("stall", m, e, w0, w1)

    def host(self, m: int, e: int, t0: float, t1: float) -> None:
        """Count an expert computed on the host from t0 to t1."""
        self.stats.layers[m][self.phase].host_s += t1 - t0
        self.event("host", m, e, t0, t1)

    def prefetch_window_s(self) -> float | None:
        """Seconds ahead a prefetch may still start: this phase's layer-time estimate x the prefetch window (None
        before the phase's first forward)."""
        w = self.window_s.get(self.phase)
        return None if w is None else w * self.prefetch_window

    def layer_s(self) -> float | None:
        """This phase's estimate of one layer's compute time (an EMA over forwards, stall excluded)."""
        return self.window_s.get(self.phase)

    def begin_forward(self, phase: str) -> None:
        """A forward of this phase starts."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r}; choose one of {PHASES}")
        self.phase = phase
        self._stall_in_forward = 0.0

    def end_forward(self, dt: float) -> None:
        """A forward of dt seconds ended: record it and update the layer-time estimate (stall excluded)."""
        self.stats.forward_s[self.phase].append(dt)
        layer_s = max(dt - self._stall_in_forward, 0.0) / self.num_layers
        old = self.window_s.get(self.phase)
        self.window_s[self.phase] = layer_s if old is None else (1 - WINDOW_EMA) * old + WINDOW_EMA * layer_s

    def reset(self, t_origin: float = 0.0) -> None:
        """Zero every counter and the timeline; timeline times restart at t_origin (the estimate is kept)."""
        self.stats.reset()
        self.t_origin = t_origin
