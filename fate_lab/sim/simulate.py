"""The timed simulator: the runtime's expert cache and layer step on a simulated clock and link.

What this file is: `simulate(trace, config, hardware, shape)` replays a recorded trace step by step as the
runtime would run it -- one prefill step per prompt (all its tokens at once), then one step per decode
token -- through `Simulator`, a driver built by the SAME driver core as the runtime (`core/driver.py`: plan,
slots, cache, predictor, miss rule, placement, stats), with `SimMover`, a discrete-event model of the link:
one queue, urgent loads before queued prefetches, cancellation of transfers not yet started, each transfer
busy for `latency + bytes / bandwidth`. The compute thread's clock advances by a `ComputeProfile`
(`hardware/compute.py`): per-layer dense compute, per-expert compute, the experts call's bookkeeping and the
host-side prediction. Output: the runtime's own `RunStats` (every table reads all drivers alike), with the
forwards' simulated times, so its `ttft_s` and `decode_tok_s` are the predicted speeds.

With the link "instant" the simulator's counts equal the runtime's exactly (tested); with a timed link they
are predictions, checked against the runtime in `benchmarks/bench_sim_vs_runtime.py`.
What it is not: no tensors move and no expert computes here.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from fate_lab.core.config import OffloadConfig, refuse_plan_request
from fate_lab.core.driver import DriverCore, Precision, link_capacity, link_view
from fate_lab.core.recorder import Recorder
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.links import LinkProfile
from fate_lab.hardware.profiles import COMPUTE_PROFILES
from fate_lab.hardware.setups import Hardware
from fate_lab.model.trace import PREFILL, Trace, router_scores
from fate_lab.policy.registry import POLICIES
from fate_lab.policy.rules import RouterScores
from fate_lab.policy.stats import RunStats
from fate_lab.policy.step import LayerCall
from fate_lab.quant import QuantSpec

__all__ = ["COMPUTE_PROFILES", "ComputeProfile", "Hardware", "ModelShape", "SimMover", "Simulator", "simulate",
           "trace_steps"]


class SimClock:
    """The compute thread's simulated time, in seconds."""

    def __init__(self) -> None:
        self.now = 0.0


@dataclass(eq=False)
class _SimTransfer:
    m: int
    e: int
    nbytes: int
    urgent: bool
    reason: str
    spec: QuantSpec | None
    submit_t: float
    start: float | None = None
    end: float | None = None
    counted: bool = False
    idle: bool = False  # (the disk model) served with the compute thread waiting
    overlapped: bool = False  # (the disk model) sped up by the readers' overlap: another read waits behind it


class SimMover:
    """The link as a discrete-event model: one queue, urgent first, `queue_depth` transfers in flight. Each holds
    its queue entry for latency + bytes / bandwidth; the latencies of entries in flight overlap, their bytes take
    turns on the one wire (`LinkProfile.stream_bandwidth`'s model). Depth 1: busy latency + bytes / bandwidth."""

    def __init__(self, spec: Precision, rec: Recorder, clock: SimClock, link: LinkProfile | None,
                 compute: ComputeProfile, shape: ModelShape):
        self.spec, self.rec = spec, rec
        self.clock, self.link, self.compute, self.shape = clock, link, compute, shape
        self.queue: list[_SimTransfer] = []  # not started, urgent ones first
        self.free_at = 0.0  # when the last started transfer ends
        # the disk model (compute.disk_model): reads served one at a time, faster by the readers' overlap (`_overlap`)
        self.disk = link is not None and compute.disk_model
        self.entries = [0.0] * (1 if link is None or self.disk else link.queue_depth)  # when each queue entry is free
        self.idle = False  # the compute thread waits (a read's host work then has the cores to itself)
        self.wire_free = 0.0  # when the bytes of the transfers started so far have all moved
        self.fresh: set[tuple[int, int]] = set()  # (layer, expert) whose bytes landed since it last computed
        self.evicting = 0.0  # landed_s owed by the next dense layer (`Simulator._dense`)
        self.slot_spec: dict[int, QuantSpec | None] = {}  # the precision each slot's last transfer brought
        self.running: _SimTransfer | None = None  # (the disk model) the read started last

    def _time(self, nbytes: int, urgent: bool = False) -> float:
        return 0.0 if self.link is None else self.link.transfer_time(nbytes) + self.compute.transfer_extra(urgent)

    def _read_s(self, nbytes: int, idle: bool) -> float:
        """The disk model's time of one read of nbytes: latency + bytes / bandwidth + the reader's host work."""
        return self.link.latency + nbytes / self.link.bandwidth + self.compute.read_host(nbytes, busy=not idle)

    def _start_next(self) -> None:
        x = self.queue.pop(0)
        if self.disk:  # one read at a time, at the pace the compute thread lets its host work go
            x.start = max(self.entries[0], x.submit_t)
            x.end = x.start + self._read_s(x.nbytes, self.idle)
            x.idle, self.running = self.idle, x
            self.entries[0] = self.wire_free = self.free_at = x.end
            if self.queue:
                self._overlap(x, x.start)
            return
        i = min(range(len(self.entries)), key=self.entries.__getitem__)
        x.start = max(self.entries[i], x.submit_t)
        t = self._time(x.nbytes, x.urgent)
        # its bytes, and the overshoot the compute profile measured (on a CPU: the reader's own conversion, digest
        # and copy, which take turns on the cores as the bytes do on the wire), follow its latency once the wire is free
        wire = 0.0 if self.link is None else x.nbytes / self.link.bandwidth + self.compute.transfer_extra(x.urgent)
        x.end = max(x.start + t, self.wire_free + wire)
        self.entries[i] = self.wire_free = x.end
        self.free_at = max(self.free_at, x.end)
        self.rec.event("demand" if x.urgent else "prefetch", x.m, x.e, x.start, x.end)

    def _advance(self) -> None:
        """Start every queued transfer the link reaches by the compute thread's now."""
        while self.queue and min(self.entries) <= self.clock.now:
            self._start_next()

    def _record(self, x: _SimTransfer) -> None:
        if not x.counted:
            x.counted = True
            if self.disk:  # its end is final only now (a wait may have shortened it)
                self.rec.event("demand" if x.urgent else "prefetch", x.m, x.e, x.start, x.end)
            self.fresh.add((x.m, x.e))
            self.evicting += self.compute.landed_s
            self.rec.landed(x.m, x.nbytes, x.spec)

    def busy(self) -> bool:
        """Is the link copying (or has queued work) at the compute thread's now?"""
        self._advance()
        return self.link is not None and (self.free_at > self.clock.now or bool(self.queue))

    def submit(self, m: int, e: int, slot: int, urgent: bool, reason: str) -> _SimTransfer:
        """Queue a transfer at the compute thread's now (after the compute thread's own time to queue it)."""
        self.stretch(self.compute.transfer_host_s)  # compute-thread work: as slow as busy readers make it (disk model)
        self._advance()
        spec = self.spec(m, reason)
        self.slot_spec[slot] = spec  # what the slot holds once these bytes land (compute waits for them)
        x = _SimTransfer(m, e, self.shape.nbytes(spec), urgent, reason, spec, self.clock.now)
        end = len(self.queue)
        pos = next((i for i, q in enumerate(self.queue) if not q.urgent), end) if urgent else end
        self.queue.insert(pos, x)
        self._overlap(self.running, self.clock.now)  # (the disk model: running is None without it)
        self._advance()
        return x

    def _overlap(self, r: _SimTransfer | None, t: float) -> None:
        """From t on, read r has another behind it: its rest goes faster by the readers' measured overlap, once."""
        if r is not None and not r.overlapped and r.end > t:
            r.end, r.overlapped = t + (r.end - t) / self.compute.reader_overlap, True
            self.entries[0] = self.wire_free = self.free_at = r.end

    def cancel(self, x: _SimTransfer) -> bool:
        """Drop x if the link has not reached it."""
        self._advance()
        if x in self.queue:
            self.queue.remove(x)
            return True
        return False

    def poll(self, x: _SimTransfer) -> bool | None:
        """Landed by now?"""
        self._advance()
        if x.end is None or x.end > self.clock.now:
            return None
        self._record(x)
        return True

    def wait(self, m: int, e: int, x: _SimTransfer) -> bool:
        """The compute thread waits until x lands (stall)."""
        self._advance()
        w0 = self.clock.now
        if self.disk and x.end is not None and x.end > w0 and not x.idle and self.entries[0] == x.end:
            # the read on the disk now goes on with the cores to itself: its rest at the idle pace
            busy, idle = self._read_s(x.nbytes, False), self._read_s(x.nbytes, True)
            x.end = w0 + (x.end - w0) * idle / busy
            x.idle = True
            self.entries[0] = self.wire_free = self.free_at = x.end
        self.idle = True
        try:
            while x.end is None:
                self._start_next()
        finally:
            self.idle = False
        if x.end > w0:
            self.clock.now = x.end + self.compute.wake_s
        self.rec.stall(m, e, w0, self.clock.now)
        self._record(x)
        return True

    def reload(self, m: int, e: int, slot: int, reason: str) -> None:  # pragma: no cover - nothing fails here
        """Simulated transfers never fail."""
        raise RuntimeError("a simulated transfer cannot fail")

    def stretch(self, work: float, dense: bool = False, predict: bool = False) -> None:
        """Move the compute thread's clock over `work` seconds of compute (a dense layer's, or an experts call's piece;
        `predict`: a prediction), slowed by the readers busy meanwhile (the disk model: min(queue depth, reads queued
        or running) readers, `ComputeProfile.slowdown`); otherwise plain."""
        if not self.disk:
            self.clock.now += work
            return
        t, rest = self.clock.now, work
        while rest > 0:
            self.clock.now = t
            self._advance()  # reads the disk reaches meanwhile start, beside compute
            running = self.entries[0] > t
            readers = min(self.link.queue_depth, len(self.queue) + running)
            f = self.compute.slowdown(readers, dense, prefill=self.rec.phase == "prefill", predict=predict)
            if not running or t + rest * f <= self.entries[0]:
                t += rest * f
                break
            rest -= (self.entries[0] - t) / f
            t = self.entries[0]
        self.clock.now = t

    def backlog_s(self) -> float:
        """Link time committed beyond now."""
        self._advance()
        running = sum(max(0.0, t - self.clock.now) for t in self.entries)
        return (running + sum(self._time(x.nbytes, x.urgent) for x in self.queue)) / len(self.entries)

    def capacity(self, m: int) -> int | None:
        """Prefetches the link can start before layer m's call (the runtime's rule, simulated estimates)."""
        if self.link is None:
            return None
        return link_capacity(self.rec.prefetch_window_s(), self.backlog_s(),
                             self._time(self.shape.nbytes(self.spec(m, "prefetch"))))

    def view(self, m: int):
        """The value planner's view of the link for layer m (`core.driver.link_view`); None on the instant link."""
        if self.link is None:
            return None
        return link_view(self.rec, self.spec, m, self.backlog_s(), lambda spec: self._time(self.shape.nbytes(spec)))


class _SimCompute:
    """The simulator's `policy.step.ComputeTarget` for one call of MoE layer m (n: tokens per expert, T: tokens in
    the step): each expert's compute time on the clock, where the layer step's dispatch sends it."""

    def __init__(self, sim: "Simulator", m: int, n: Counter, T: int = 1):
        self.sim, self.m, self.n, self.T = sim, m, n, T

    def on_device(self, e: int, slot: int) -> None:
        sim, comp, clock = self.sim, self.sim.hw.compute, self.sim.clock
        c0 = clock.now
        cold = comp.expert_cold_s if (self.m, e) in sim.mover.fresh else 0.0
        if sim.mover.slot_spec.get(slot) is not None:  # a packed slot: dequantized first, at every use
            sim.compute(comp.dequant_s)
        sim.compute(comp.expert(self.n[e], self.T))
        clock.now += cold
        sim.mover.fresh.discard((self.m, e))
        sim.core.recorder.event("compute", self.m, e, c0, clock.now)

    def on_host(self, e: int) -> None:  # the host CPU: its profile's time (+ the emulated hold's sleep overshoot)
        sim, comp, clock = self.sim, self.sim.hw.compute, self.sim.clock
        c0 = clock.now
        sim.mover.stretch(sim.core.host_time(self.n[e]))  # never slowed by busy_factor (the disk refuses host compute)
        clock.now += comp.link_extra_s
        sim.core.recorder.host(self.m, e, c0, clock.now)
        sim.mover.evicting += comp.landed_s  # its weights streamed through the dense layers' caches

    def from_standin(self, e: int) -> None:  # the INT2 copy (the dequantize is not modelled: OUR simplification)
        sim, clock = self.sim, self.sim.clock
        c0 = clock.now
        sim.compute(sim.hw.compute.expert(self.n[e], self.T))
        sim.core.recorder.event("compute_lowp", self.m, e, c0, clock.now)


class Simulator:
    """The simulated driver: the driver core, a simulated clock and link, and the compute profile's times."""

    def __init__(self, config: OffloadConfig, hardware: Hardware, shape: ModelShape,
                 router: RouterScores | None = None, miss_curves=None, predictor=None):
        self.core = DriverCore(config, shape, hardware, driver="simulator", router=router, store="simulated",
                               miss_curves=miss_curves, predictor=predictor)
        self.hw, self.shape, self.config = self.core.hardware, shape, config
        if self.hw.compute is None:
            raise ValueError("the simulator needs a compute profile: Hardware(compute=ComputeProfile(...), link=...), "
                             "a named setup (Hardware.setup / Hardware.scaled) or a calibrated one")
        self.clock = SimClock()
        self.mover = SimMover(self.core.spec, self.core.recorder, self.clock, self.hw.link, self.hw.compute, shape)
        self.cache = self.core.build_cache(self.mover)
        for m, _e, slot in self.core.preload():  # all_resident: marked resident before the first token, nothing moves
            self.mover.slot_spec[slot] = self.core.spec(m, "cache")  # at the cache's precision, as the runtime loads

    def compute(self, seconds: float, predict: bool = False) -> None:
        """The compute thread computes for `seconds` (its time alone; `predict`: a prediction): slowed by the disk's
        readers as they run (the disk model, `SimMover.stretch`), else by `busy_factor` if the link is busy now."""
        if self.mover.disk:
            self.mover.stretch(seconds, predict=predict)
            return
        f = self.hw.compute.busy_factor
        self.clock.now += seconds * (f if f != 1.0 and self.mover.busy() else 1.0)

    @property
    def stats(self) -> RunStats:
        """The run's counters and simulated forward times."""
        return self.core.stats

    def advance(self, seconds: float) -> None:
        """Let the compute thread spend `seconds` outside the model (e.g. a draft proposing tokens)."""
        self.clock.now += seconds

    def forward(self, experts: torch.Tensor, gate_inputs: torch.Tensor | None = None, phase: str | None = None,
                weights: torch.Tensor | None = None) -> float:
        """One forward (a prefill step or a decode token): experts [T, M, K], gate_inputs [T, M, H],
        weights [T, M, K] (the top-k gate weights; lossy configs only). Returns its simulated seconds.
        phase: None infers it (T > 1: prefill); "decode" with T > 1 is a speculative verify step."""
        T = experts.shape[0]
        comp, M, core, clock = self.hw.compute, self.shape.num_moe_layers, self.core, self.clock
        rec = core.recorder
        core.begin_forward(phase or ("prefill" if T > 1 else "decode"))
        t0 = clock.now
        for _ in range(self.shape.num_layers - M):  # dense-only decoder layers (e.g. DeepSeek's first)
            self._dense(T)
        for m in range(M):
            self._dense(T)
            t_call = clock.now
            self.compute(comp.call(T))
            idx = experts[:, m]  # (T, K)
            counts = Counter(idx.reshape(-1).tolist())

            def timed(fn, m=m):
                p0 = clock.now
                out = fn()
                self.compute(comp.predict(T, self.config.prefetch.predictor), predict=True)
                rec.event("predict", m, -1, p0, clock.now)
                return out

            core.run_layer(LayerCall(m, idx, _SimCompute(self, m, counts, T),
                                     gate_input=None if gate_inputs is None else gate_inputs[:, m],
                                     weights=None if weights is None else weights[:, m], timed=timed))
            rec.stats.layers[m][rec.phase].compute_s += clock.now - t_call
        self._dense(T, compute=False)  # what the last layer's landings evicted: the head and the next forward
        dt = clock.now - t0
        rec.end_forward(dt)
        return dt

    def _dense(self, T: int, compute: bool = True) -> None:
        """One dense layer of T tokens, slower by what landed since the last one (`ComputeProfile.landed_s` each:
        copies and host computes evict its weights from the shared caches) -- at most its own time again, since
        it re-reads its weights once however much evicted them."""
        d = self.hw.compute.dense(T)
        if compute:  # the dense layer is not slowed by busy_factor (its pieces were measured beside the link)
            self.mover.stretch(d, dense=True)
        self.clock.now += min(self.mover.evicting, d)
        self.mover.evicting = 0.0


def trace_steps(trace: Trace) -> list[tuple[int, int]]:
    """(start, end) rows of each forward the runtime would run: a prompt's prefill rows together, each decode row
    alone."""
    phase, pid = trace.phase.tolist(), trace.prompt_id.tolist()
    steps, i, N = [], 0, len(phase)
    while i < N:
        j = i + 1
        if phase[i] == PREFILL:
            while j < N and phase[j] == PREFILL and pid[j] == pid[i]:
                j += 1
        steps.append((i, j))
        i = j
    return steps


def needs_router(config: OffloadConfig) -> bool:
    """True when a config reads the router's scores (cross-layer or learned gate, commit, router_ema)."""
    return config.prefetch.predictor in ("cross_layer_gate", "learned_gate") or config.lossy.kind == "commit" or \
        POLICIES[config.cache.replacement.lower()].needs_scores


def check_trace(trace: Trace, config: OffloadConfig, shape: ModelShape, router=None) -> RouterScores | None:
    """ValueError unless the trace fits the shape and holds what the config reads; the router it gives (router:
    the model's own routers, `MoEAdapter.host_routers()`, for a router the trace's weights cannot reproduce)."""
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
    refuse_plan_request(config, "fate_lab.sim.simulate")
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a fate_lab Trace (record_trace / from_routing_array / Trace.load), got "
                        f"{type(trace).__name__}")
    if trace.num_layers != shape.num_moe_layers or trace.top_k != shape.top_k:
        raise ValueError(f"the trace has {trace.num_layers} MoE layers x top-{trace.top_k}, the shape "
                         f"{shape.num_moe_layers} x top-{shape.top_k}")
    if trace.num_experts != shape.num_experts:
        raise ValueError(f"the trace is of a model with {trace.num_experts} experts per layer (ids up to "
                         f"{trace.num_experts - 1}), the shape has {shape.num_experts}: simulate it with the shape of "
                         "the model it was recorded on (a routing array: from_routing_array(..., num_experts=E))")
    if config.lossy.kind in ("drop", "substitute") and trace.weights is None:
        raise ValueError(f"lossy={config.lossy.kind!r} reads the top-k gate weights: simulate a trace that has them "
                         "(record_trace keeps them)")
    if not needs_router(config):
        return None
    if trace.gate_inputs is None or (trace.router_weights is None and router is None
                                     and trace.meta.get("router_linear") is not False):
        raise ValueError("the cross-layer gate predictor and score-reading replacement policies need a trace with "
                         "gate inputs and router weights (record it with record_trace); routing-only traces support "
                         "predictor=None or 'activation_path'")
    if router is not None:
        if len(router) != shape.num_moe_layers:
            raise ValueError(f"router holds {len(router)} MoE layers' routers, the shape {shape.num_moe_layers}")
        return router
    return router_scores(trace)


def simulate(trace: Trace, config: OffloadConfig, hardware: Hardware, shape: ModelShape,
             miss_curves=None, router=None, predictor=None) -> RunStats:
    """Run `config` over the trace on `hardware` (semantics in the module docstring); the predicted speeds are
    the returned stats' `ttft_s` and `decode_tok_s`. router: the model's own routers (`MoEAdapter.host_routers()`),
    needed where the trace's router weights cannot reproduce them (a non-linear router); default: the trace's.
    A plan request (`auto`) is refused: `fate_lab.simulate` plans it first from a calibration trace of the shape's
    model (never this trace); `predictor` replaces the config's (a study's bound)."""
    router = check_trace(trace, config, shape, router)
    sim = Simulator(config, hardware, shape, router=router, miss_curves=miss_curves, predictor=predictor)
    gi = trace.gate_inputs.float() if router is not None else None
    phase = trace.phase.tolist()
    for a, b in trace_steps(trace):  # the trace's phase: a prompt's first forward is its prefill, one token or more
        sim.forward(trace.experts[a:b], None if gi is None else gi[a:b],
                    phase="prefill" if phase[a] == PREFILL else "decode",
                    weights=None if config.lossy.kind is None else trace.weights[a:b])
    return sim.stats
