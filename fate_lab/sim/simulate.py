"""The timed simulator: the runtime's expert cache and layer step on a simulated clock and link.

What this file is: `simulate(trace, config, hardware, shape)` replays a recorded trace step by
step as the runtime would run it -- one prefill step per prompt (all its tokens at once), then
one step per decode token -- through the SAME `cache.ExpertCache`, `step.run_layer`,
predictors and planner as `runtime.Runtime`, driven by `SimLink`, a discrete-event model of
the link: one queue, urgent loads before queued prefetches, cancellation of transfers not yet
started, each transfer busy for `latency + bytes / bandwidth`. The compute thread's clock
advances by a `ComputeProfile`: per-layer dense compute, per-expert compute, the experts
call's bookkeeping and the host-side prediction. Output: a `SimResult` holding the runtime's
own `RuntimeStats` (so every table and plot reads both alike), its timeline format, and the
predicted time to first token and decode tokens/s.

Hardware: `ComputeProfile`s are calibrated on this machine from the runtime itself
(`calibrate.calibrate_compute`), or named for real setups in `COMPUTE_PROFILES` (each number with its
source); links are `links.LinkProfile`s. With the link "instant" the simulator's counts equal
the runtime's exactly (tested); with a timed link they are predictions, checked against the
runtime in `benchmarks/bench_sim_vs_runtime.py`.
What it is not: no tensors move and no expert computes here.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from fate_lab.model.trace import PREFILL, Trace
from fate_lab.offloading.builders import build_miss_policy, build_predictor, model_source, predictor_scores
from fate_lab.offloading.config import OffloadConfig
from fate_lab.offloading.engine_link import STALL_MIN_S, WINDOW_EMA, link_capacity, spec_label
from fate_lab.offloading.host import HostTime, host_profile
from fate_lab.offloading.links import LINK_PROFILES, LinkProfile
from fate_lab.offloading.slots import slot_sizing, standin_pool_bytes
from fate_lab.offloading.stats import PHASES, PhaseStats, RuntimeStats
from fate_lab.policy.cache import HOST, ExpertCache
from fate_lab.policy.lossy import LOWP
from fate_lab.policy.placement import HostPlacement, host_layer_set
from fate_lab.policy.planner import plan_offload
from fate_lab.policy.predictors import Predictor, next_layer_scores
from fate_lab.policy.replacement import POLICIES, policy_from_name
from fate_lab.policy.step import run_layer
from fate_lab.quant import QuantPolicy, QuantSpec, expert_nbytes


@dataclass(frozen=True)
class ComputeProfile:
    """Seconds the device (and host) spend per piece of one forward; T tokens in the step."""

    name: str
    dense_s: float  # one decoder layer without its routed experts, one decode token
    dense_per_token_s: float  # extra per additional token of a prefill step
    expert_s: float  # one routed expert on one token (incl. the runtime's per-expert bookkeeping)
    expert_per_token_s: float  # extra per additional token routed to that expert
    call_s: float  # the experts call's own bookkeeping (cache, routing ids to the host)
    predict_s: float  # host-side cross-layer prediction of one layer, one token
    predict_per_token_s: float = 0.0  # extra per additional token
    expert_cold_s: float = 0.0  # extra for an expert whose bytes just landed (CPU emulation: they sit in
    # the other core's cache; 0 on a GPU, where a kernel reads device memory either way)
    landed_s: float = 0.0  # extra dense time per landed transfer (CPU emulation: the link's copies
    # evict the dense weights from the shared caches; 0 on a GPU)
    link_extra_s: float = 0.0  # an emulated transfer's overshoot beyond latency + bytes/bandwidth (sleep
    # granularity of the worker thread); 0 for a real link
    wake_s: float = 0.0  # from a transfer landing to the waiting compute thread running again
    source: str = ""

    def dense(self, T: int) -> float:
        """One layer's dense compute for T tokens."""
        return self.dense_s + self.dense_per_token_s * (T - 1)

    def expert(self, n: int) -> float:
        """One expert's compute on n tokens."""
        return self.expert_s + self.expert_per_token_s * (n - 1)

    def predict(self, T: int) -> float:
        """One host-side prediction for T tokens."""
        return self.predict_s + self.predict_per_token_s * (T - 1)


# Qwen1.5-MoE-A2.7B fp16, batch 1, eager PyTorch. A decode layer reads attention 33.6 MB + shared
# expert 69.2 MB at ~936 GB/s x 0.7 (RTX 3090) ~ 0.16 ms plus ~20 launches x 10 us ~ 0.2 ms -> 0.36 ms
# dense; one routed expert (17.3 MB) 0.026 ms + 3 launches -> ~0.035 ms; 4 of them + dense ~ 0.5 ms,
# matching links.REAL_SETUPS' 0.5 ms layer estimate (OUR estimate, not the paper's). Host prediction:
# a [1, 2048] x [2048, 60] GEMV + sort on a desktop CPU ~ 20 us (measured order of magnitude here).
# RTX 4090 (1008 GB/s, faster launches) ~ 0.8x; a laptop RTX 4060 (256 GB/s) ~ 2.5x the dense time.
COMPUTE_PROFILES: dict[str, ComputeProfile] = {
    "qwen15_moe_rtx3090": ComputeProfile("Qwen1.5-MoE-A2.7B fp16 on RTX 3090", 0.36e-3, 0.002e-3, 0.035e-3,
                                         0.0005e-3, 0.01e-3, 0.02e-3, 0.0,
                                         source="roofline + launch overhead estimate (see module comment)"),
    "qwen15_moe_rtx4090": ComputeProfile("Qwen1.5-MoE-A2.7B fp16 on RTX 4090", 0.29e-3, 0.0015e-3, 0.028e-3,
                                         0.0004e-3, 0.01e-3, 0.02e-3, 0.0, source="RTX 3090 estimate x 0.8"),
    "qwen15_moe_laptop4060": ComputeProfile("Qwen1.5-MoE-A2.7B fp16 on a laptop RTX 4060", 0.9e-3, 0.005e-3,
                                            0.09e-3, 0.001e-3, 0.01e-3, 0.03e-3, 0.0,
                                            source="RTX 3090 estimate x 2.5 (256 vs 936 GB/s)"),
    "qwen15_moe_orin": ComputeProfile("Qwen1.5-MoE-A2.7B fp16 on a Jetson AGX Orin (unified memory)", 1.8e-3,
                                      0.01e-3, 0.17e-3, 0.002e-3, 0.02e-3, 0.06e-3, 0.0,
                                      source="204.8 GB/s LPDDR5 at ~0.6 efficiency; ~5x the RTX 3090 estimate"),
}

_QWEN15_EXPERT_BYTES = 3 * 2048 * 1408 * 2  # Qwen1.5-MoE-A2.7B: one routed expert, fp16

# Named setups: a compute profile and a link (links.LINK_PROFILES); experts read over that link.
SETUPS: dict[str, tuple[str, str]] = {
    "qwen15_moe_rtx3090_pcie3": ("qwen15_moe_rtx3090", "pcie3_x16"),
    "qwen15_moe_rtx3090_pcie4": ("qwen15_moe_rtx3090", "pcie4_x16"),
    "qwen15_moe_rtx4090_pcie4": ("qwen15_moe_rtx4090", "pcie4_x16"),
    "qwen15_moe_laptop4060_pcie4x8": ("qwen15_moe_laptop4060", "pcie3_x16"),  # x8 Gen4 ~ x16 Gen3 bandwidth
    "qwen15_moe_orin_nvme": ("qwen15_moe_orin", "nvme"),
}


@dataclass(frozen=True)
class Hardware:
    """A compute profile and the link experts travel over."""

    compute: ComputeProfile
    link: LinkProfile | None  # None: the instant link (transfers take no time)
    host_ref: tuple[int, float, float] | None = None  # host compute (OffloadConfig.host): the expert whose host
    # time is charged, (bytes, FLOPs per token, clock scale), as `host.HostTime`; None: the model's own at scale 1

    def host_time(self, profile: str, shape: "ModelShape") -> HostTime:
        """Seconds one expert takes on the host CPU `profile` (a `host.HOST_PROFILES` key) for n tokens."""
        if self.host_ref is None:
            return HostTime(host_profile(profile), shape.nbytes(None), shape.expert_flops())
        return HostTime(host_profile(profile), *self.host_ref)

    @classmethod
    def setup(cls, name: str, expert_bytes: int | None = None) -> "Hardware":
        """A named real setup (`SETUPS`). With `expert_bytes` (a small model's expert), the link is scaled so
        that one such expert takes as long as one of the setup's real model (Qwen1.5-MoE fp16, 17.3 MB):
        the small model's routing on the real machine's clock."""
        if name not in SETUPS:
            raise ValueError(f"unknown setup {name!r}; choose one of {sorted(SETUPS)}")
        comp, link = SETUPS[name]
        prof = LINK_PROFILES[link]
        if expert_bytes is not None:
            real = _QWEN15_EXPERT_BYTES
            prof = LinkProfile(f"{prof.name} (scaled to a {real / 1e6:.1f} MB expert)", prof.bandwidth * expert_bytes / real,
                               prof.latency, prof.source, scaled_from=name)
            # the host computes the real model's expert too (fp16: FLOPs per token == bytes)
            return cls(COMPUTE_PROFILES[comp], prof, (real, float(real), 1.0))
        return cls(COMPUTE_PROFILES[comp], prof)


@dataclass(frozen=True)
class ModelShape:
    """What the simulator needs to know of a model (sizes for bytes and the plan)."""

    num_layers: int  # decoder layers (dense and MoE)
    num_moe_layers: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int  # routed expert width
    dtype: torch.dtype
    dense_bytes: int
    kv_bytes_per_token: int
    scoring: str = "softmax"
    # the model's folder: where a learned predictor's probes and a substitute's similarity table are
    # looked up when the config names no other folder (as the runtime does with the model it runs)
    source: str = ""

    @classmethod
    def from_adapter(cls, adapter) -> "ModelShape":
        """The shape of a model seen through `adapters.adapt(model)`."""
        return cls(len(getattr(adapter.model, "model", adapter.model).layers), adapter.num_moe_layers,
                   adapter.num_experts, adapter.top_k, adapter.hidden_size, adapter.expert_intermediate_size,
                   adapter.experts_module(0).gate_up_proj.dtype if adapter.experts_module(0).gate_up_proj.numel()
                   else adapter.model.dtype, adapter.dense_bytes(), adapter.kv_bytes_per_token(),
                   adapter.router_spec.scoring, model_source(adapter.model))

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """gate_up (2I, H) and down (H, I)."""
        return {"gate_up": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}

    def nbytes(self, spec: QuantSpec | None) -> int:
        """Bytes of one expert travelling at spec (None: full precision)."""
        return expert_nbytes(self.expert_shapes(), spec, dtype=self.dtype)

    def expert_flops(self) -> float:
        """FLOPs of one routed expert on one token (gate, up and down projections)."""
        return 2.0 * 3 * self.hidden * self.intermediate




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


class SimLink:
    """The link as a discrete-event model: one queue, urgent first, busy latency + bytes / bandwidth."""

    def __init__(self, sim: "_Sim", link: LinkProfile | None):
        self.sim, self.link = sim, link
        self.queue: list[_SimTransfer] = []  # not started, urgent ones first
        self.free_at = 0.0
        self.fresh: set[tuple[int, int]] = set()  # (layer, expert) whose bytes landed since it last computed

    def _time(self, nbytes: int) -> float:
        return 0.0 if self.link is None else self.link.transfer_time(nbytes) + self.sim.hw.compute.link_extra_s

    def _start_next(self) -> None:
        x = self.queue.pop(0)
        x.start = max(self.free_at, x.submit_t)
        x.end = x.start + self._time(x.nbytes)
        self.free_at = x.end
        self.sim.event("demand" if x.urgent else "prefetch", x.m, x.e, x.start, x.end)

    def _advance(self) -> None:
        """Start every queued transfer the link reaches by the compute thread's now."""
        while self.queue and self.free_at <= self.sim.now:
            self._start_next()

    def _record(self, x: _SimTransfer) -> None:
        if not x.counted:
            x.counted = True
            self.fresh.add((x.m, x.e))
            self.sim.now += self.sim.hw.compute.landed_s
            self.sim.stats.layers[x.m][self.sim.phase].bytes_moved += x.nbytes
            self.sim.stats.moved[self.sim.phase, x.m, spec_label(x.spec)] += 1

    def submit(self, m: int, e: int, slot: int, urgent: bool, reason: str) -> _SimTransfer:
        """Queue a transfer at the compute thread's now."""
        self._advance()
        spec = self.sim.spec(m, reason)
        x = _SimTransfer(m, e, self.sim.shape.nbytes(spec), urgent, reason, spec, self.sim.now)
        pos = next((i for i, q in enumerate(self.queue) if not q.urgent), len(self.queue)) if urgent else len(self.queue)
        self.queue.insert(pos, x)
        self._advance()
        return x

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
        if x.end is None or x.end > self.sim.now:
            return None
        self._record(x)
        return True

    def wait(self, m: int, e: int, x: _SimTransfer) -> bool:
        """The compute thread waits until x lands (stall)."""
        self._advance()
        while x.end is None:
            self._start_next()
        w0 = self.sim.now
        if x.end > w0:
            self.sim.now = x.end + self.sim.hw.compute.wake_s
        self.sim.stall(m, e, w0, self.sim.now)
        self._record(x)
        return True

    def reload(self, m: int, e: int, slot: int, reason: str) -> None:  # pragma: no cover - nothing fails here
        """Simulated transfers never fail."""
        raise RuntimeError("a simulated transfer cannot fail")

    def backlog_s(self) -> float:
        """Link time committed beyond now."""
        self._advance()
        return max(0.0, self.free_at - self.sim.now) + sum(self._time(x.nbytes) for x in self.queue)

    def capacity(self, m: int) -> int | None:
        """Prefetches the link can start before layer m's call (the runtime's rule, simulated estimates)."""
        if self.link is None:
            return None
        w = self.sim.window_s.get(self.sim.phase)
        return link_capacity(None if w is None else w * self.sim.config.prefetch_window, self.backlog_s(),
                             self._time(self.sim.shape.nbytes(self.sim.spec(m, "prefetch"))))


@dataclass
class SimResult:
    """What `simulate` returns: the runtime's stats type, plus the predicted speeds."""

    stats: RuntimeStats
    ttft_s: float  # mean time of a prompt's prefill step (time to first token)
    decode_tok_s: float  # decode steps / decode time
    slots_per_layer: list[int]
    hardware: Hardware

    def summary(self) -> dict:
        """`RuntimeStats.summary()` plus ttft_s and decode_tok_s."""
        out = self.stats.summary()
        out["ttft_s"], out["decode_tok_s"] = self.ttft_s, self.decode_tok_s
        return out


class _Sim:
    """State of one simulation: clock, phase, counters and the parts shared with the runtime."""

    def __init__(self, config: OffloadConfig, hardware: Hardware, shape: ModelShape, curves=None):
        self.config, self.hw, self.shape = config, hardware, shape
        M = shape.num_moe_layers
        self.quant = QuantPolicy.preset(config.quant) if config.quant is not None else None
        es = shape.expert_shapes()
        _, slot_bytes, scratch = slot_sizing(self.quant, M, es["gate_up"], es["down"], shape.dtype, shape.nbytes(None))
        if config.lossy == "standin":  # the resident INT2 copies come off the cache budget, as in the runtime
            scratch += standin_pool_bytes(M, shape.num_experts, es["gate_up"], es["down"])
        self.plan, self.slots_per_layer, buffers = plan_offload(
            config, num_layers=M, num_experts=shape.num_experts, top_k=shape.top_k, slot_expert_bytes=slot_bytes,
            dense_bytes=shape.dense_bytes, kv_bytes_per_token=shape.kv_bytes_per_token, scratch_bytes=scratch,
            miss_curves=curves)
        self.stats = RuntimeStats(layers=[{p: PhaseStats() for p in PHASES} for _ in range(M)],
                                  link="instant" if hardware.link is None else hardware.link.describe(),
                                  store="simulated", plan=self.plan, slots_per_layer=list(self.slots_per_layer))
        self.link = SimLink(self, hardware.link)
        self.host_time: HostTime | None = None
        placement = None
        if config.host is not None:
            self.host_time = hardware.host_time(config.host_profile, shape)
            placement = HostPlacement(config.host, host_layer_set(config.host, config.host_layers, M), self.host_time,
                                      0.0 if hardware.link is None else hardware.link.transfer_time(shape.nbytes(None)))
        self.miss_policy = build_miss_policy(config, M, shape.num_experts, shape.source or None)
        self.cache = ExpertCache(self.slots_per_layer, lambda m, c: policy_from_name(config.replacement, c),
                                 shape.top_k, buffers, self.link, self.stats.layers, cache=config.cache,
                                 admit_on_use=config.admit_prefetch == "on_use",
                                 link_budget=config.prefetch_budget == "link", placement=placement)
        self.predictor: Predictor | None = build_predictor(config, M, shape.num_experts, shape.hidden, shape.top_k,
                                                                  shape.source or None)
        self.now, self.phase = 0.0, "prefill"
        self.window_s: dict[str, float] = {}
        self._stall_in_forward = 0.0
        if config.all_resident:
            for m in range(M):
                self.cache.preload(m, list(range(min(self.slots_per_layer[m], shape.num_experts))))

    def spec(self, m: int, reason: str) -> QuantSpec | None:
        return None if self.quant is None else self.quant.precision_for(m, reason)

    def event(self, kind: str, m: int, e: int, t0: float, t1: float) -> None:
        tl = self.stats.timeline
        if self.config.timeline and len(tl) < self.config.timeline_max_events:
            tl.append((kind, m, e, t0, t1))

    def stall(self, m: int, e: int, w0: float, w1: float) -> None:
        if w1 - w0 > STALL_MIN_S:
            self.stats.layers[m][self.phase].stall_s += w1 - w0
            self._stall_in_forward += w1 - w0
            self.event("stall", m, e, w0, w1)

    def forward(self, experts: torch.Tensor, gate_inputs: torch.Tensor | None, router_weights,
                phase: str | None = None, weights: torch.Tensor | None = None) -> float:
        """One forward (a prefill step or a decode token): experts [T, M, K], gate_inputs [T, M, H],
        weights [T, M, K] (the top-k gate weights; lossy configs only).
        phase: None infers it (T > 1: prefill); "decode" with T > 1 is a speculative verify step."""
        T = experts.shape[0]
        comp, M = self.hw.compute, self.shape.num_moe_layers
        self.phase = self.cache.phase = phase or ("prefill" if T > 1 else "decode")
        if self.phase == "prefill" and self.predictor is not None:
            self.predictor.reset()
        if hasattr(self.predictor, "set_phase"):  # a learned gate keeps one threshold per phase
            self.predictor.set_phase(self.phase)
        t0, self._stall_in_forward = self.now, 0.0
        dense_layers = self.shape.num_layers - M
        self.now += dense_layers * comp.dense(T)  # dense-only decoder layers (e.g. DeepSeek's first)
        low = self.quant.prefill_low_count if self.quant is not None and self.phase == "prefill" else None
        for m in range(M):
            self.now += comp.dense(T)
            t_call = self.now
            self.now += comp.call_s
            idx = experts[:, m]  # (T, K)
            counts = Counter(idx.reshape(-1).tolist())

            def compute(e: int, slot: int, n=counts, m=m) -> None:
                c0 = self.now
                if slot == LOWP:  # from the resident INT2 copy (the dequantize is not modelled: OUR simplification)
                    self.now += comp.expert(n[e])
                    self.event("compute_lowp", m, e, c0, self.now)
                    return
                if slot == HOST:  # on the host CPU: its profile's time (+ the emulated hold's sleep overshoot)
                    self.now += self.host_time(n[e]) + comp.link_extra_s
                    self.stats.layers[m][self.phase].host_s += self.now - c0
                    self.event("host", m, e, c0, self.now)
                    return
                self.now += comp.expert(n[e]) + (comp.expert_cold_s if (m, e) in self.link.fresh else 0.0)
                self.link.fresh.discard((m, e))
                self.event("compute", m, e, c0, self.now)

            def scores(m=m):
                if gate_inputs is None:
                    return None
                return predictor_scores(self.predictor, m, gate_inputs[:, m], router_weights[m + 1], self.shape.scoring)

            def timed_predict(fn, m=m):
                p0 = self.now
                out = fn()
                self.now += comp.predict(T)
                self.event("predict", m, -1, p0, self.now)
                return out

            def own_scores(m=m):
                if gate_inputs is None:
                    return None
                return next_layer_scores(router_weights[m], gate_inputs[:, m], self.shape.scoring)

            run_layer(self.cache, self.predictor, m, idx, scores, compute, self.config.popularity_order, low,
                      timed_predict, own_scores if gate_inputs is not None else None, self.miss_policy,
                      None if weights is None else weights[:, m])
            self.stats.layers[m][self.phase].compute_s += self.now - t_call
        dt = self.now - t0
        self.stats.forward_s[self.phase].append(dt)
        layer_s = max(dt - self._stall_in_forward, 0.0) / self.shape.num_layers
        old = self.window_s.get(self.phase)
        self.window_s[self.phase] = layer_s if old is None else (1 - WINDOW_EMA) * old + WINDOW_EMA * layer_s
        return dt


def trace_steps(trace: Trace) -> list[tuple[int, int]]:
    """(start, end) rows of each forward the runtime would run: a prompt's prefill rows together, each decode row alone."""
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


def simulate(trace: Trace, config: OffloadConfig, hardware: Hardware, shape: ModelShape,
             miss_curves=None) -> SimResult:
    """Run `config` over the trace on `hardware` (semantics in the module docstring)."""
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig, got {type(config).__name__}")
    if trace.num_layers != shape.num_moe_layers or trace.top_k != shape.top_k:
        raise ValueError(f"the trace has {trace.num_layers} MoE layers x top-{trace.top_k}, the shape "
                         f"{shape.num_moe_layers} x top-{shape.top_k}")
    if config.lossy in ("drop", "substitute") and trace.weights is None:
        raise ValueError(f"lossy={config.lossy!r} reads the top-k gate weights: simulate a trace that has them "
                         "(record_trace keeps them)")
    needs_gate = config.predictor in ("cross_layer_gate", "learned_gate") or config.lossy == "commit" or \
        getattr(POLICIES.get(config.replacement.lower()), "wants_scores", False)  # router_ema reads the router
    if needs_gate and (trace.gate_inputs is None or trace.router_weights is None):
        raise ValueError("the cross-layer gate predictor and score-reading replacement policies need a trace with "
                         "gate inputs and router weights "
                         "(record it with record_trace); routing-only traces support predictor=None or "
                         "'activation_path'")
    sim = _Sim(config, hardware, shape, curves=miss_curves)
    gi = trace.gate_inputs.float() if needs_gate else None
    rw = [w.float() for w in trace.router_weights] if needs_gate else None
    for a, b in trace_steps(trace):
        sim.forward(trace.experts[a:b], None if gi is None else gi[a:b], rw,
                    weights=None if config.lossy is None else trace.weights[a:b])
    pre, dec = sim.stats.forward_s["prefill"], sim.stats.forward_s["decode"]
    return SimResult(sim.stats, sum(pre) / len(pre) if pre else float("nan"),
                     len(dec) / sum(dec) if dec and sum(dec) > 0 else float("nan"), list(sim.slots_per_layer), hardware)
