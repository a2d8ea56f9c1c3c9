"""The driver core: what the runtime, the timed simulator and the replay build from one config, in one place.

What this file is: `DriverCore`, built from one `OffloadConfig`, one `ModelShape` and one `Hardware`:
  1. the precision policy and the bytes of a device slot (`core/sizing.py`);
  2. the memory plan and the slots per MoE layer (`policy/planner.py`, `policy/allocation.py`);
  3. the stats every driver returns (`policy/stats.RunStats`);
  4. the host placement (which misses compute on the host, `policy/placement.py`);
  5. the predictor and the lossy miss rule (`core/parts.py`), and the layer step's rules;
  6. the one expert cache, over the driver's own link (`build_cache`: the value cache when a value knob is on),
     and the all-resident preload;
and the precision each transfer travels at (`spec`). What a driver records while it runs (stats, timeline, stall,
phase, layer-time estimate) is the `Recorder` (`recorder.py`) it builds and hands on: a link (real engine,
simulated, instant) gets that recorder and `spec`, and nothing else of the core.
What it is not: a driver or a recorder. It moves no bytes, computes no expert and reads no clock: the runtime, the
simulator and the replay own their mechanisms and hand `run_layer` a `LayerCall`.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from fate_lab.core.config import OffloadConfig, refuse_plan_request
from fate_lab.core.parts import build_miss_policy, build_predictor
from fate_lab.core.recorder import Recorder
from fate_lab.core.shape import ModelShape
from fate_lab.core.sizing import STANDIN_SPEC, slot_sizing, standin_pool_bytes
from fate_lab.hardware.setups import Hardware
from fate_lab.policy.cache import ExpertCache, Mover
from fate_lab.policy.placement import HostPlacement, host_layer_set
from fate_lab.policy.planner import plan_offload
from fate_lab.policy.predictors import Predictor
from fate_lab.policy.registry import policy_from_name
from fate_lab.policy.replacement import ReplacementPolicy
from fate_lab.policy.rules import RouterScores
from fate_lab.policy.stats import PHASES, PhaseStats, RunStats
from fate_lab.policy.step import LayerCall, StepRules, run_layer
from fate_lab.policy.value import LinkView
from fate_lab.policy.value_cache import ValueCache
from fate_lab.quant import QuantPolicy, QuantSpec, expert_nbytes

Precision = Callable[[int, str], "QuantSpec | None"]  # (MoE layer, reason) -> the precision a transfer travels at


def link_capacity(window_s: float | None, backlog_s: float, transfer_s: float) -> int | None:
    """Prefetches a link can *start* within window_s when backlog_s of work is already queued.

    None (no limit) without a window estimate or with a zero-time link. A transfer that starts
    inside the window but lands after it still saves part of the wait, so this counts starts:
    ceil((window - backlog) / transfer), at least 0.
    """
    if window_s is None or transfer_s <= 0:
        return None
    return max(0, math.ceil((window_s - backlog_s) / transfer_s - 1e-9))


def link_view(rec: Recorder, spec: Precision, m: int, backlog_s: float, seconds) -> LinkView | None:
    """The value planner's `LinkView` of a timed link for layer m's transfers: the phase's layer-time estimate,
    the link's backlog, and seconds(spec) of one transfer at each reason's precision. None before the first
    forward of the phase has been timed (the value cache then keeps the plain rule)."""
    layer = rec.layer_s()
    if layer is None:
        return None
    return LinkView(layer, backlog_s, seconds(spec(m, "prefetch")), seconds(spec(m, "miss")),
                    low_s=seconds(spec(m, "prefetch_low")))


def scaling_bytes(shape: ModelShape, quant: QuantPolicy | None) -> int:
    """The expert size a scaled setup's link is fitted to (`Setup.on_clock`): the model's expert as it travels at
    full precision; with quantization, the model's expert at fp16 -- the precision the real setups move -- so a
    packed INT4 expert takes the real INT4 expert's time whatever the model's own dtype."""
    if quant is None:
        return shape.nbytes(None)
    return expert_nbytes(shape.expert_shapes(), None, dtype=torch.float16)


class DriverCore:
    """Everything a driver builds from (config, shape, hardware), and the `Recorder` it records into."""

    def __init__(self, config: OffloadConfig, shape: ModelShape, hardware: Hardware, *, driver: str,
                 router: RouterScores | None = None, store: str = "", link_note: str = "", miss_curves=None,
                 predictor: Predictor | None = None):
        """driver: "runtime" | "simulator" | "replay" (names the stats); router: every MoE layer's router on
        the host (None: a routing-only trace); miss_curves(): LRU curves for allocation="miss_curve";
        predictor: one to use instead of the config's (a study's bound, e.g. the simulator's oracle)."""
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig (e.g. OffloadConfig.preset('fate')), got "
                            f"{type(config).__name__}")
        refuse_plan_request(config, "the driver core")
        self.config, self.shape, self.driver = config, shape, driver
        M, E, K = shape.num_moe_layers, shape.num_experts, shape.top_k
        es = shape.expert_shapes()
        # 1. precision policy and slot sizing
        quant = config.precision.quant
        self.quant: QuantPolicy | None = QuantPolicy.preset(quant) if quant is not None else None
        self.hardware = hardware.for_model(scaling_bytes(shape, self.quant))  # a scaled setup: the one rule
        hardware = self.hardware
        if self.quant is not None:  # refuse a group size the experts' shapes cannot take, naming them
            for m in range(M):
                for s in self.quant.host_specs(m):
                    self._check_quantizable(s)
        self.slot_specs, self.slot_bytes, scratch = slot_sizing(self.quant, M, es, shape.dtype, shape.nbytes(None))
        self.standin_bytes = 0
        if config.lossy.kind == "standin":
            if shape.expert_width % STANDIN_SPEC.group_size or shape.intermediate % STANDIN_SPEC.group_size:
                raise ValueError(f"lossy='standin' keeps INT2 copies with group size {STANDIN_SPEC.group_size}, which "
                                 f"must divide the hidden size {shape.expert_width} and the expert width "
                                 f"{shape.intermediate}")
            biases = {n: v for n, v in es.items() if n.endswith("_bias")}
            self.standin_bytes = standin_pool_bytes(M, E, es["gate_up"], es["down"], biases, shape.dtype)
        # 2. the memory plan (the resident INT2 copies come off the cache budget)
        self.plan, self.slots_per_layer, self.prefetch_buffers = plan_offload(
            config, num_layers=M, num_experts=E, top_k=K, slot_expert_bytes=self.slot_bytes,
            dense_bytes=shape.dense_bytes, kv_bytes_per_token=shape.kv_bytes_per_token,
            scratch_bytes=scratch + self.standin_bytes, miss_curves=miss_curves)
        self.num_slots = sum(self.slots_per_layer) + K + 2 * self.prefetch_buffers
        # 3. the stats every driver returns
        link = "instant (transfers land at once)" if hardware.link is None else hardware.link.describe()
        self.link_description = link  # the link both drivers of one config model (the runtime may note more)
        self.stats = RunStats(layers=[{p: PhaseStats() for p in PHASES} for _ in range(M)], link=link + link_note,
                              store=store, plan=self.plan, slots_per_layer=list(self.slots_per_layer), driver=driver,
                              expert_bytes=shape.nbytes(None))
        self.recorder = Recorder(self.stats, shape.num_layers, config.timeline, config.prefetch.window)
        # 4. host placement: a miss computes on the host when the config says so
        self.host_time = None
        self.placement: HostPlacement | None = None
        place = config.placement
        if place.host is not None:
            self.host_time = hardware.host_time(place.profile, shape.nbytes(None), shape.expert_flops())
            self.placement = HostPlacement(place.host, host_layer_set(place.host, place.layers, M),
                                           self.host_time, hardware.transfer_s(shape.nbytes(None)))
        # 5. the policies and the layer step's rules
        self.miss_policy = build_miss_policy(config, shape)
        self.predictor = predictor if predictor is not None else build_predictor(config, shape)
        self.rules = StepRules(self.predictor, router, config.cache.popularity_order, self.miss_policy,
                               self.quant.prefill_low_count if self.quant is not None else None,
                               depth=config.prefetch_depth)
        self.cache: ExpertCache | None = None

    def _check_quantizable(self, spec: QuantSpec | None) -> None:
        try:
            expert_nbytes(self.shape.expert_shapes(), spec, dtype=self.shape.dtype)
        except ValueError as exc:
            raise ValueError(f"quant={self.config.precision.quant!r} cannot quantize this model's experts: {exc}. "
                             f"Choose a policy whose group size divides hidden {self.shape.hidden} and expert width "
                             f"{self.shape.intermediate}") from exc

    # --- 6. the one cache, over the driver's link ----------------------------------------
    def replacement(self, m: int, capacity: int) -> ReplacementPolicy:
        """Layer m's replacement policy, of the config's kind, over `capacity` slots."""
        return policy_from_name(self.config.cache.replacement, capacity, self.shape.num_experts)

    def build_cache(self, mover: Mover) -> ExpertCache:
        """The one expert cache over this driver's mover (what moves experts over its link), with the config's
        flags."""
        c = self.config
        value = {}
        cls = ExpertCache
        if c.prefetch_value or c.placement.fill:  # the opt-in value knobs: the cache that plans (value_cache.py)
            cls, value = ValueCache, {"value_prefetch": c.prefetch_value, "host_fill": c.placement.fill,
                                      "low_offered": c.prefetch_low}
        self.cache = cls(self.slots_per_layer, self.replacement, self.shape.top_k, self.prefetch_buffers, mover,
                         self.stats.layers, cache=c.cache.keep, admit_on_use=c.prefetch.admit == "on_use",
                         link_budget=c.prefetch.budget == "link", placement=self.placement, **value)
        assert self.cache.num_slots == self.num_slots
        return self.cache

    def preload(self) -> list[tuple[int, int, int]]:
        """all_resident: mark every expert cached before the first token; (layer, expert, slot) to load."""
        if not self.config.cache.all_resident:
            return []
        return [(m, e, slot) for m in range(self.shape.num_moe_layers)
                for e, slot in self.cache.preload(m, list(range(min(self.slots_per_layer[m], self.shape.num_experts))))]

    # --- the precision a transfer travels at ---------------------------------------------------------
    def spec(self, m: int, reason: str) -> QuantSpec | None:
        """The precision expert transfers of MoE layer m travel at for reason (None: full); a "prefetch_low"
        (`prefetch_low`: a late prefetch sent low) travels at the miss precision, a "fill" (`host_fill`) at the
        prefetch precision."""
        if self.quant is None:
            return None
        return self.quant.precision_for(m, {"prefetch_low": "miss", "fill": "prefetch"}.get(reason, reason))

    # --- per forward -----------------------------------------------------------------------
    def begin_forward(self, phase: str) -> None:
        """A forward starts: its phase reaches the recorder, the cache and the predictor (a prompt resets
        history). Its end is the recorder's (`recorder.end_forward`)."""
        self.recorder.begin_forward(phase)
        if self.cache is not None:
            self.cache.phase = phase
        if self.predictor is not None:
            if phase == "prefill":
                self.predictor.reset()
            self.predictor.set_phase(phase)

    def run_layer(self, call: LayerCall) -> list[int]:
        """One experts call through the layer step (`policy/step.py`); returns the compute order."""
        return run_layer(self.cache, self.rules, call)

    def reset_stats(self, t_origin: float = 0.0) -> None:
        """Zero every counter and the timeline (the cache contents stay); timeline times restart at t_origin."""
        self.recorder.reset(t_origin)
        if self.cache is not None:
            self.cache.stats = self.stats.layers

    def describe(self) -> dict:
        """What this core built, as plain data: two drivers of one config must describe the same build."""
        pred = self.predictor
        return {"config": self.config, "shape": self.shape, "plan": self.plan,
                "slots_per_layer": list(self.slots_per_layer), "prefetch_buffers": self.prefetch_buffers,
                "num_slots": self.num_slots, "slot_bytes": self.slot_bytes, "slot_specs": self.slot_specs,
                "standin_bytes": self.standin_bytes, "quant": self.quant,
                "predictor": None if pred is None else (type(pred).__name__, getattr(pred, "rule", None)),
                "miss_policy": None if self.miss_policy is None else (self.miss_policy.kind,
                                                                      self.miss_policy.threshold),
                "placement": None if self.placement is None else (self.placement.mode, self.placement.host_layers,
                                                                  self.placement.transfer_s),
                "host_time": self.host_time, "link": self.link_description,
                "replacement": self.config.cache.replacement}
