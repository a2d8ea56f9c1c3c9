"""The offloaded MoE runtime: experts really move, and `model.generate()` keeps working.

What this file is: `OffloadConfig` (frozen, presets by name) and `offload(model, config) ->
Runtime`. `offload` copies every routed expert to the host store, frees the model's fused
expert tensors on the device, preallocates the device expert slots once from the memory
plan, and plugs `OffloadedExperts` in through transformers' experts registry
(`ExpertsInterface.register("fate_offload", ...)` + `model.set_experts_implementation`).

In the experts call of MoE layer m (its `hidden_states [T, H]` *is* layer m's gate input):
1. stale prefetches for layer m are dropped (counted as wasted); misses are queued as urgent
   on-demand loads;
2. Fate's cross-layer prefetch: the gate input goes to the host, layer m+1's router weight
   (a host copy) scores it there, the predictor picks experts, and the non-resident ones are
   queued for transfer most probable first;
3. layer m's experts are computed from the device slots: resident ones first (in prefill in
   order of popularity, so their compute hides the transfer of the rest), waiting on
   in-flight transfers (stall time) and loading failed transfers synchronously.
Attention, norms, routers and shared experts stay untouched on the device.

Device slots (allocated once): each MoE layer owns the cache slots the allocation policy
gives it, managed by its replacement policy; a shared staging area holds experts that are
not cached (`top_k` slots for on-demand loads plus the prefetch buffers: the planner's
"buffers"). Experts in use or with a transfer in flight are never evicted. A queued
prefetch that its layer turns out not to need is cancelled when the layer starts.

Quantized experts (`OffloadConfig.quant`, a `quant.QuantPolicy` preset name; None = full
precision): the host store keeps the packed copies the policy needs (`QuantizedStore`,
`policy.host_specs(m)`); every transfer carries a precision chosen by its reason --
"prefetch" for predicted experts, "prefill_low" for the least popular `prefill_low_share` of the
experts a prefill step sends ahead (the tail of the predictor's most-probable-first order,
counted over those that got a slot), "miss" for
on-demand loads, "cache" for the all-resident preload. Bytes moved are the packed sizes;
`stats.moved` counts landed transfers per (phase, layer, precision).
Device slots under quantization are *packed* (`transfer.PackedSlots`): every cache and staging
slot is a row of one uint8 pool, `slot_expert_bytes` wide = the largest layout of any precision
that travels (INT4 codes + fp16 scales + zeros under `fate`; segments 8-byte aligned). The link
moves the packed bytes into the slot as they are; an expert that arrives at a lower precision
(INT2 misses and prefill tail) sits in the same slot in its own, smaller packed form (the rest
of the row is unused), so a slot holds whatever precision last arrived in it. Right before an
expert computes, its slot is dequantized into `_SCRATCH_SLOTS` (one) full-precision scratch
expert (experts compute one after another, so one suffices); every use of a cached expert
dequantizes again, as Fate's dequantize-before-compute does. The planner counts the packed
slots plus that scratch (`plan.buffer_bytes`), so `device_bytes()` + the planned KV stays within
the budget. A precision of None in a policy (a full-precision layer override) is held in the
pool as raw bytes of the model dtype and computes in place.
Departures from Fate, stated plainly:
* an expert loaded on demand at INT2 that gets a cache slot stays cached at INT2 until
  evicted (the paper does not say whether INT2 misses are cached);
* on a scaled link (`links.REAL_SETUPS`) with quantization on, the link is calibrated on the
  tiny model's expert at fp16 (the real setups move fp16 experts), so an INT4 expert takes
  0.28x the real fp16 expert's time whatever the tiny model's own dtype; without quantization
  it stays calibrated on the model's own dtype, as before.

What it is not: no policy lives here. Predictors (`predictors.py`), slot allocation
(`allocation.py`), replacement (`replacement.py`) and the budget arithmetic (`planner.py`)
are the same objects the replay simulator uses; the byte moving is `transfer.py`/`store.py`.
Letters: T tokens, K experts per token (top-k), H hidden, I expert intermediate, E experts.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from .adapters import MoEAdapter, adapt
from .allocation import allocation_from_name
from .links import LINK_PROFILES, LinkProfile, resolve_link
from .planner import plan_from_slots, plan_memory
from .stats import PHASES, PhaseStats, RuntimeStats
from .predictors import ActivationPath, CrossLayerGate, Percentile, Predictor, SelectionRule, TopK
from .quant import QuantPolicy, QuantSpec, expert_nbytes
from .replacement import policy_from_name
from .store import HostStore, QuantizedStore, RamStore, SafetensorsStore
from .transfer import CudaCopyEngine, EmulatedLink, PackedSlots, Transfer, TransferEngine, _SlotWriter

IMPLEMENTATION = "fate_offload"
_SCRATCH_SLOTS = 1  # full-precision experts a packed-slot (quantized) runtime dequantizes into


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class OffloadConfig:
    """Every knob of the runtime; `OffloadConfig.preset(name, **overrides)` for the baselines."""

    name: str = "custom"
    budget: int | None = None  # device bytes for dense + KV + buffers + expert cache ...
    slots: int | None = None  # ... or the expert cache size in slots; neither: every expert fits
    link: str = "pcie3_x16"  # links.LINK_PROFILES key, or links.REAL_SETUPS key for the scaled mode
    predictor: str | None = "cross_layer_gate"  # None | "cross_layer_gate" | "activation_path"
    rule: SelectionRule | None = Percentile(75.0)  # cross-layer gate rule; None: TopK(model top_k)
    allocation: str = "shallow"  # allocation.ALLOCATIONS key
    shallow_layers: int | None = None  # Fate's L for allocation="shallow"; None: 1/8 of the MoE layers
    # (the paper uses L = 3-4 of Qwen1.5-MoE's 24 layers), at least 1
    replacement: str = "arc"  # replacement.POLICIES key
    cache: bool = True  # False: nothing stays on the device after use (load on demand)
    all_resident: bool = False  # upper bound: every expert gets a slot, loaded before the first token;
    # budget/slots are then ignored
    popularity_order: bool = True  # prefill computes popular experts first
    prefetch_buffer_experts: int | None = None  # staging slots beyond top_k; None: top_k if prefetching
    context_len: int = 512  # tokens of KV cache the budget must hold
    store: str = "ram"  # "ram" | "ssd" (read experts from `checkpoint` safetensors on demand)
    checkpoint: str | None = None  # safetensors file/folder for store="ssd"
    native_link: bool = False  # on CUDA: the real PCIe link instead of an emulated profile
    calibration_steps: int = 12  # decode steps timed to calibrate the scaled link
    layer_compute_s: float | None = None  # scaled link: the tiny model's layer time; None: calibrate now
    timeline: bool = True  # record (kind, layer, expert, t_start, t_end) events
    timeline_max_events: int = 200_000
    quant: str | None = None  # quant.QuantPolicy preset ("fate", "int8", "int4", ...); None: full precision

    @staticmethod
    def preset_names(include_quant: bool = False) -> list[str]:
        """Names accepted by `preset`; the quantized ones (whose output differs) only with include_quant."""
        return list(_PRESETS) + (list(_QUANT_PRESETS) if include_quant else [])

    @classmethod
    def preset(cls, name: str, **overrides) -> "OffloadConfig":
        """A named baseline with any field overridden (budget=..., slots=..., link=..., ...)."""
        known = {**_PRESETS, **_QUANT_PRESETS}
        if name not in known:
            raise ValueError(f"unknown preset {name!r}; choose one of {list(known)}")
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"OffloadConfig has no field(s) {sorted(unknown)}")
        return dataclasses.replace(known[name], **overrides)


_PRESETS: dict[str, OffloadConfig] = {
    # upper bound: every expert has a slot and is loaded before the first token
    "all_resident": OffloadConfig("all_resident", predictor=None, allocation="uniform", replacement="lru",
                                  all_resident=True),
    # the paper's baseline: no cache, no prefetch; every use is a synchronous load
    "load_on_demand": OffloadConfig("load_on_demand", predictor=None, allocation="uniform", replacement="lru",
                                    cache=False, popularity_order=False),
    # plain offloading: on-demand loads kept in a per-layer LRU cache
    "lru": OffloadConfig("lru", predictor=None, allocation="uniform", replacement="lru"),
    # mixtral-offloading: LRU + next layer's router applied to this gate input, top-k speculative loads
    "mixtral_offloading": OffloadConfig("mixtral_offloading", predictor="cross_layer_gate", rule=None,
                                        allocation="uniform", replacement="lru"),
    # EAP baseline: expert-activation-path history predictor, LRU cache
    "activation_path": OffloadConfig("activation_path", predictor="activation_path", allocation="uniform",
                                     replacement="lru"),
    # Fate: cross-layer gate + 75th-percentile expansion, shallow-favoring allocation, ARC
    "fate": OffloadConfig("fate"),
}

# Quantized presets: the same runtime policies as `fate`, experts stored and moved packed.
# Their output differs from the full-precision model's, so `preset_names()` lists them apart.
_QUANT_PRESETS: dict[str, OffloadConfig] = {
    # Fate's scheme: INT4 cache/prefetch, INT2 misses and least popular prefill experts
    "fate_quant": dataclasses.replace(_PRESETS["fate"], name="fate_quant", quant="fate"),
    # every expert at INT8 (g64): the near-lossless check
    "fate_int8": dataclasses.replace(_PRESETS["fate"], name="fate_int8", quant="int8"),
}


# ----------------------------------------------------------------------------- the runtime


def _fate_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """Experts implementation registered as "fate_offload": defers to the runtime attached to the module."""
    block = getattr(self, "_fate_offloaded", None)
    if block is None:
        raise RuntimeError(
            "experts_implementation='fate_offload' is set but this experts module is not offloaded; "
            "call fate_lab.offload(model, config), or model.set_experts_implementation('eager')"
        )
    return block.runtime._layer_forward(block.m, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, _fate_experts_forward)


@dataclass(eq=False)
class OffloadedExperts:
    """What the runtime attaches to one HF experts module: its MoE layer index and the runtime."""

    m: int
    runtime: "Runtime"


@dataclass(eq=False)
class _Layer:
    """Slot bookkeeping of one MoE layer (compute thread only)."""

    cache_slots: list[int]  # global slot ids owned by this layer's cache
    policy: object  # replacement policy over expert ids, capacity len(cache_slots)
    where: dict[int, int] = field(default_factory=dict)  # cached (reserved) expert -> slot
    valid: set[int] = field(default_factory=set)  # cached experts whose slot holds their bytes
    staged: dict[int, int] = field(default_factory=dict)  # expert -> staging slot (not cached)
    inflight: dict[int, Transfer] = field(default_factory=dict)  # expert -> transfer in flight
    prefetched: set[int] = field(default_factory=set)  # experts the predictor moved for the next call
    prediction: list[int] | None = None  # predicted set for the next call of this layer

    @property
    def free(self) -> list[int]:
        """Cache slots reserved by nobody."""
        used = set(self.where.values())
        return [s for s in self.cache_slots if s not in used]


class Runtime:
    """An offloaded MoE model; build it with `offload(model, config)`, end it with `close()`."""

    def __init__(self, model: nn.Module, config: OffloadConfig):
        self.model, self.config = model, config
        self.adapter: MoEAdapter = adapt(model)
        a = self.adapter
        self.device = a.experts_module(0).gate_up_proj.device
        self.dtype = a.experts_module(0).gate_up_proj.dtype
        for m in range(a.num_moe_layers):
            self._check_experts_module(a.experts_module(m))
        self.top_k, self.num_experts, M = a.top_k, a.num_experts, a.num_moe_layers
        self.expert_bytes = a.bytes_per_expert()  # one expert at full precision (the model's dtype)
        self.quant: QuantPolicy | None = QuantPolicy.preset(config.quant) if config.quant is not None else None
        # what one device slot holds: the largest precision that ever travels (packed slots), and
        # the fp scratch a packed expert is dequantized into before it computes
        self.slot_expert_bytes, scratch_bytes = self.expert_bytes, 0
        if self.quant is not None:
            for m in range(M):  # refuses a group size the experts' shapes cannot take
                for s in self.quant.host_specs(m):
                    self._precision_nbytes(s)
            self._slot_specs = tuple(dict.fromkeys(s for m in range(M) for s in self.quant.host_specs(m)))
            self.slot_expert_bytes = max(PackedSlots.layout_bytes(*self._expert_shapes(), s, self.dtype)
                                         for s in self._slot_specs)
            scratch_bytes = _SCRATCH_SLOTS * self.expert_bytes

        # 1. the memory plan and per-layer slots (pure policies)
        self.prefetching = config.predictor is not None
        buffers = config.prefetch_buffer_experts
        buffers = (self.top_k if self.prefetching else 0) if buffers is None else buffers
        dense, kv = a.dense_bytes(), a.kv_bytes_per_token()
        if config.budget is not None and config.slots is not None:
            raise ValueError("give the budget either in bytes (budget=) or in expert slots (slots=), not both")
        if config.budget is not None and not config.all_resident:
            self.plan = plan_memory(config.budget, dense, kv, config.context_len, self.slot_expert_bytes, M,
                                    self.top_k, buffers, num_experts=self.num_experts, scratch_bytes=scratch_bytes)
        else:
            slots = M * self.num_experts
            if config.slots is not None and not config.all_resident:
                slots = min(config.slots, slots)
            self.plan = plan_from_slots(slots, dense, kv, config.context_len, self.slot_expert_bytes, M,
                                        self.top_k, buffers, scratch_bytes=scratch_bytes)
        cache_total = self.plan.cache_total if config.cache else 0
        shallow = config.shallow_layers if config.shallow_layers is not None else max(1, round(M / 8))
        params = {"shallow_layers": shallow} if config.allocation == "shallow" else {}
        self.slots_per_layer = allocation_from_name(config.allocation, **params).allocate(
            cache_total, M, self.num_experts)
        n_staging = self.top_k + buffers

        # 2. host store; the fused tensors leave the device; then the device slots, allocated once
        self.store = self._build_store()
        self.layer_compute_s = None  # the scaled link's calibration needs the experts still in place
        if config.link not in LINK_PROFILES:
            self.layer_compute_s = config.layer_compute_s or calibrate_layer_time(model, config.calibration_steps)
        self._free_fused_experts()
        try:
            self._build_rest(model, config, n_staging)
        except BaseException:
            if getattr(self, "engine", None) is not None:
                self.engine.close()
            self._restore_fused_experts()
            raise

    def _build_rest(self, model: nn.Module, config: OffloadConfig, n_staging: int) -> None:
        """Slots, link, predictor, engine, stats and the registry hook-up (the experts are on the host now)."""
        a, M = self.adapter, self.adapter.num_moe_layers
        inter, hidden = a.expert_intermediate_size, a.hidden_size
        n_slots = sum(self.slots_per_layer) + n_staging
        self.packed_slots: PackedSlots | None = None
        if self.quant is None:
            self.gate_up_slots = torch.empty(n_slots, 2 * inter, hidden, dtype=self.dtype, device=self.device)  # (S, 2I, H)
            self.down_slots = torch.empty(n_slots, hidden, inter, dtype=self.dtype, device=self.device)  # (S, H, I)
        else:  # packed slots (uint8 pool [S, slot_expert_bytes]); gate_up/down_slots are the fp scratch
            self.packed_slots = PackedSlots(*self._expert_shapes(), self._slot_specs, self.dtype, n_slots,
                                            _SCRATCH_SLOTS, self.device)
            assert self.packed_slots.slot_bytes == self.slot_expert_bytes
            self.gate_up_slots = self.packed_slots.gate_up_scratch  # (n, 2I, H)
            self.down_slots = self.packed_slots.down_scratch  # (n, H, I)
        self.layers: list[_Layer] = []
        base = 0
        for m, c in enumerate(self.slots_per_layer):
            self.layers.append(_Layer(list(range(base, base + c)), policy_from_name(config.replacement, c)))
            base += c
        # staging slots hold experts that are not cached: top_k for on-demand loads, the rest for prefetches
        self.demand_free: list[int] = list(range(base, base + self.top_k))
        self.prefetch_free: list[int] = list(range(base + self.top_k, n_slots))
        self._first_prefetch_slot = base + self.top_k
        self.n_staging = n_staging
        self._zombies: list[tuple[int, Transfer]] = []  # staging slots whose unneeded transfer runs on

        # 3. link, predictor, host router copies, transfer engine, stats
        # scaled links: the real setups move fp16 experts; with quantization, calibrate on the fp16 size
        link_ref = self.expert_bytes if self.quant is None else a.bytes_per_expert(torch.float16)
        self.link: LinkProfile = resolve_link(config.link, link_ref, self.layer_compute_s)
        self.predictor: Predictor | None = self._build_predictor()
        self.router_host = [a.router_weight(m).detach().to("cpu", torch.float32).clone() for m in range(M)]  # (E, H)
        self._writer = _SlotWriter(self.store, self.gate_up_slots, self.down_slots, self.packed_slots)  # sync loads
        self.engine: TransferEngine = self._build_engine()
        self.stats = RuntimeStats(
            layers=[{p: PhaseStats() for p in PHASES} for _ in range(M)],
            link=self.link.describe() + (" [native CUDA]" if isinstance(self.engine, CudaCopyEngine) else ""),
            store=self.store.describe(), plan=self.plan, slots_per_layer=list(self.slots_per_layer),
        )
        self.phase = "prefill"
        self._t0 = time.perf_counter()
        self._closed = False
        if config.all_resident:
            self._preload()

        # 4. plug in through transformers' experts registry
        self._prev_impl = model.config._experts_implementation
        for m in range(M):
            a.experts_module(m)._fate_offloaded = OffloadedExperts(m, self)
        model.set_experts_implementation(IMPLEMENTATION)
        self._hooks = [model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                       model.register_forward_hook(self._post_forward)]

    # --- construction helpers ----------------------------------------------------------
    @staticmethod
    def _check_experts_module(mod: nn.Module) -> None:
        for flag, want in (("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                           ("has_gate", True), ("has_post_expert_norm", False)):
            if getattr(mod, flag, want) != want:
                raise NotImplementedError(f"{type(mod).__name__}.{flag}={not want} is not supported by the runtime")

    def _expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(gate_up (2I, H), down (H, I)) of one expert."""
        a = self.adapter
        return (2 * a.expert_intermediate_size, a.hidden_size), (a.hidden_size, a.expert_intermediate_size)

    def _precision_nbytes(self, spec: QuantSpec | None) -> int:
        """Bytes of one expert at spec (packed + scales + zeros), or at full precision for None."""
        a = self.adapter
        shapes = {"gate_up": (2 * a.expert_intermediate_size, a.hidden_size),
                  "down": (a.hidden_size, a.expert_intermediate_size)}
        try:
            return expert_nbytes(shapes, spec, dtype=self.dtype)
        except ValueError as exc:
            raise ValueError(f"quant={self.config.quant!r} cannot quantize this model's experts: {exc}. Choose a "
                             f"policy whose group size divides hidden {a.hidden_size} and expert width "
                             f"{a.expert_intermediate_size}") from exc

    def _spec(self, m: int, reason: str) -> QuantSpec | None:
        """The precision expert transfers of MoE layer m travel at for reason (None: full)."""
        return None if self.quant is None else self.quant.precision_for(m, reason)

    def _build_store(self) -> HostStore:
        cfg, a = self.config, self.adapter
        pin = self.device.type == "cuda"
        if cfg.store == "ram":
            base: HostStore = RamStore.from_adapter(a, pin=pin)
        elif cfg.store == "ssd":
            if cfg.checkpoint is None:
                raise ValueError("store='ssd' needs checkpoint=<safetensors file or folder of the model>")
            base = SafetensorsStore(cfg.checkpoint, a.moe_layers, a.num_experts, self.dtype)
        else:
            raise ValueError(f"unknown store {cfg.store!r}; choose 'ram' or 'ssd'")
        if self.quant is None:
            return base
        return QuantizedStore(base, [self.quant.host_specs(m) for m in range(a.num_moe_layers)], pin=pin)

    def _build_predictor(self) -> Predictor | None:
        cfg = self.config
        if cfg.predictor is None:
            return None
        if cfg.predictor == "cross_layer_gate":
            return CrossLayerGate(cfg.rule if cfg.rule is not None else TopK(self.top_k))
        if cfg.predictor == "activation_path":
            return ActivationPath()
        raise ValueError(f"unknown predictor {cfg.predictor!r}; choose None, 'cross_layer_gate' or 'activation_path'")

    def _build_engine(self) -> TransferEngine:
        if self.device.type == "cuda" and self.config.native_link:
            return CudaCopyEngine(self.store, self.gate_up_slots, self.down_slots, packed_slots=self.packed_slots)
        return EmulatedLink(self.store, self.gate_up_slots, self.down_slots, self.link, packed_slots=self.packed_slots)

    def _free_fused_experts(self) -> None:
        """Replace the fused expert tensors by empty ones: the device keeps no routed expert."""
        for m in range(self.adapter.num_moe_layers):
            mod = self.adapter.experts_module(m)
            for name in ("gate_up_proj", "down_proj"):
                setattr(mod, name, nn.Parameter(torch.empty(0, dtype=self.dtype, device=self.device),
                                                requires_grad=False))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _restore_fused_experts(self) -> None:
        """Put every layer's fused expert tensors back on the device from the host store."""
        for m in range(self.adapter.num_moe_layers):
            mod = self.adapter.experts_module(m)
            gate_up, down = self.store.layer(m)  # (E, 2I, H), (E, H, I)
            mod.gate_up_proj = nn.Parameter(gate_up.to(self.device), requires_grad=False)
            mod.down_proj = nn.Parameter(down.to(self.device), requires_grad=False)

    def _preload(self) -> None:
        """Fill every cache slot, expert 0 upwards (the all-resident upper bound)."""
        for m, layer in enumerate(self.layers):
            for e in range(min(len(layer.cache_slots), self.num_experts)):
                layer.policy.admit(e)
                layer.where[e] = layer.cache_slots[e]
                self.engine_load_now(m, e, layer.cache_slots[e], timed=False, spec=self._spec(m, "cache"))
                layer.valid.add(e)

    # --- hooks around each forward ------------------------------------------------------
    def _pre_forward(self, _module, args, kwargs) -> None:
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        self.phase = "prefill" if x is not None and x.shape[1] > 1 else "decode"
        if self.phase == "prefill" and self.predictor is not None:
            self.predictor.reset()
        self._fwd_t0 = time.perf_counter()

    def _post_forward(self, _module, _args, _out) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.forward_s[self.phase].append(time.perf_counter() - self._fwd_t0)

    # --- the experts call of MoE layer m ------------------------------------------------
    @torch.no_grad()
    def _layer_forward(self, m: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
        """Offloaded experts of MoE layer m: hidden_states [T, H], top_k_index/weights [T, K] -> [T, H]."""
        if self._closed:
            raise RuntimeError("this Runtime is closed; offload the model again to run it offloaded")
        t_call = time.perf_counter()
        st = self.stats.layers[m][self.phase]
        st.calls += 1
        layer = self.layers[m]
        T, K = top_k_index.shape
        idx_host = top_k_index.detach().to("cpu")  # (T, K)
        flat = idx_host.reshape(-1).tolist()  # (T*K,) expert per (token, k) slot
        count = Counter(flat)
        needed = sorted(count, key=lambda e: (-count[e], flat.index(e))) if self.config.popularity_order else \
            sorted(count)
        needed_set = set(needed)
        self._reap()
        self._settle(m)

        # prefetch bookkeeping for this layer: recall/precision, useful/wasted, stale drops
        if layer.prediction is not None:
            pred = set(layer.prediction)
            st.predictions += 1
            st.predicted += len(pred)
            st.predicted_used += len(pred & needed_set)
            st.true_used += len(needed_set)
        layer.prediction = None
        st.prefetch_useful += len(layer.prefetched & needed_set)
        st.prefetch_wasted += len(layer.prefetched - needed_set)
        layer.prefetched = set()
        self._drop_stale(m, needed_set)

        # classify, then queue on-demand loads (urgent) before this call's prefetches
        st.uses += len(needed)
        ready, waiting, missing = [], [], []
        for e in needed:
            if e in layer.inflight:
                waiting.append(e)
                st.late += 1
            elif e in layer.staged or e in layer.valid:
                ready.append(e)
                st.hits += 1
                if e in layer.where:
                    layer.policy.access(e)
            else:
                missing.append(e)
                st.misses += 1
        order = ready + waiting + missing  # resident first: their compute hides the transfers
        pending = set(order)  # protected: needed and not computed yet
        for e in waiting:  # a needed prefetch still queued is now urgent: it goes before the misses
            t = layer.inflight[e]
            if not t.urgent and self.engine.cancel(t):
                self._submit(m, e, t.slot, urgent=True, spec=t.spec)
        deferred = [e for e in missing if not self._demand(m, e, frozenset(pending))]

        if self.predictor is not None and m + 1 < len(self.layers):
            self._prefetch(m, hidden_states, idx_host)
        if self.predictor is not None:
            self.predictor.observe(m, idx_host)

        # compute in order; results land per (token, k) position and are summed like HF's grouped_mm
        out_dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        weighted = torch.zeros(T * K, hidden_states.shape[1], dtype=out_dtype, device=hidden_states.device)  # (T*K, H)
        flat_idx = top_k_index.reshape(-1)  # (T*K,)
        flat_w = top_k_weights.reshape(-1)  # (T*K,)
        experts_mod = self.adapter.experts_module(m)
        for e in order:
            # slots freed by computed experts: queue deferred loads in compute order (keeps the link busy)
            while deferred and self._demand(m, deferred[0], frozenset(pending)):
                deferred.pop(0)
            if deferred and deferred[0] == e:  # e is next and still has no slot: make one free
                deferred.pop(0)
                if not self._demand(m, e, frozenset(pending), blocking=True):
                    raise RuntimeError(f"no slot for expert {e} of MoE layer {m} (runtime bug)")
            slot = self._ready_slot(m, e, st)
            t0 = time.perf_counter()
            if self.packed_slots is None:
                gate_up, down = self.gate_up_slots[slot], self.down_slots[slot]  # (2I, H), (H, I)
            else:  # packed slot: dequantized into the fp scratch on the device, right before it computes
                gate_up, down = self.packed_slots.weights(slot)
            if T == 1:  # decode: expert e sits at one position k of the single token
                k = flat.index(e)
                h = experts_mod._apply_gate(F.linear(hidden_states, gate_up))  # (1, I)
                weighted[k:k + 1] = F.linear(h, down) * flat_w[k:k + 1, None]  # (1, H)
            else:
                pos = (flat_idx == e).nonzero().squeeze(1)  # (n,) flat (token, k) positions of e
                x = hidden_states[pos // K]  # (n, H)
                h = experts_mod._apply_gate(F.linear(x, gate_up))  # (n, I)
                weighted[pos] = F.linear(h, down) * flat_w[pos].unsqueeze(-1)  # (n, H)
            self._event("compute", m, e, t0, time.perf_counter())
            pending.discard(e)
            if e in layer.staged and e not in layer.inflight:
                self._release(layer.staged.pop(e))
        if not self.config.cache:
            layer.valid.clear()
        st.compute_s += time.perf_counter() - t_call
        return weighted.view(T, K, -1).sum(dim=1).to(hidden_states.dtype)  # (T, H)

    # --- slots and transfers ------------------------------------------------------------
    def _take_staging(self, for_prefetch: bool) -> int | None:
        """A free staging slot: prefetches use the prefetch buffers only, on-demand loads both pools."""
        pools = (self.prefetch_free,) if for_prefetch else (self.demand_free, self.prefetch_free)
        for pool in pools:
            if pool:
                return pool.pop()
        return None

    def _release(self, slot: int) -> None:
        """Give a staging slot back to its pool."""
        (self.prefetch_free if slot >= self._first_prefetch_slot else self.demand_free).append(slot)

    @property
    def staging_free(self) -> list[int]:
        """Free staging slots of both pools."""
        return self.demand_free + self.prefetch_free

    def _reserve(self, m: int, e: int, protect: frozenset, for_prefetch: bool) -> tuple[int, bool] | None:
        """A slot for expert e of layer m: (slot, cached) from the cache policy or staging; None if none."""
        layer = self.layers[m]
        if e in layer.where:  # reserved earlier but its bytes never arrived (dropped or failed)
            layer.policy.access(e)
            return layer.where[e], True
        if self.config.cache and layer.cache_slots:
            victim = layer.policy.admit(e, protect)
            if victim != e:
                if victim is None:
                    slot = layer.free[0]
                else:
                    slot = layer.where.pop(victim)
                    layer.valid.discard(victim)
                layer.where[e] = slot
                return slot, True
        slot = self._take_staging(for_prefetch)
        if slot is None:
            return None
        layer.staged[e] = slot
        return slot, False

    def _submit(self, m: int, e: int, slot: int, urgent: bool, spec: QuantSpec | None = None) -> Transfer:
        t = self.engine.submit(m, e, slot, urgent=urgent, spec=spec)
        self.layers[m].inflight[e] = t
        return t

    def _demand(self, m: int, e: int, protect: frozenset, blocking: bool = False) -> bool:
        """Queue an urgent load of e; False if no slot is free now (blocking: make one free)."""
        got = self._reserve(m, e, protect | self._inflight_ids(m), for_prefetch=False)
        if got is None and blocking:
            self._reap(wait=True)
            self._steal_staging(m)
            got = self._reserve(m, e, protect | self._inflight_ids(m), for_prefetch=False)
        if got is None:
            return False
        self._submit(m, e, got[0], urgent=True, spec=self._spec(m, "miss"))
        return True

    def _inflight_ids(self, m: int) -> frozenset:
        """Experts of layer m with a transfer in flight (never evicted)."""
        return frozenset(self.layers[m].inflight)

    def _steal_staging(self, m: int) -> None:
        """Free the staging slots other layers' prefetches hold (last resort for on-demand loads)."""
        for n, layer in enumerate(self.layers):
            if n == m:
                continue
            for e in list(layer.staged):
                t = layer.inflight.pop(e, None)
                if t is not None and not self.engine.cancel(t):
                    self.engine.wait(t)
                    self._record_transfer(n, t)
                self._release(layer.staged.pop(e))
                layer.prefetched.discard(e)
                self.stats.layers[n][self.phase].prefetch_wasted += 1

    def _ready_slot(self, m: int, e: int, st: PhaseStats) -> int:
        """Slot of e once its bytes are there: waits on its transfer, reloads synchronously on failure."""
        layer = self.layers[m]
        slot = layer.staged.get(e, layer.where.get(e))
        t = layer.inflight.pop(e, None)
        if t is not None:
            w0 = time.perf_counter()
            ok = self.engine.wait(t)
            self._record_transfer(m, t)
            if not ok:
                st.failures += 1
                self.engine_load_now(m, e, slot, spec=t.spec)
                st.bytes_moved += self._writer.nbytes(m, e, t.spec)
                self.stats.moved[self.phase, m, spec_label(t.spec)] += 1
            w1 = time.perf_counter()
            if w1 - w0 > 2e-5:
                st.stall_s += w1 - w0
                self._event("stall", m, e, w0, w1)
        if e in layer.where:
            layer.valid.add(e)
        return slot

    def engine_load_now(self, m: int, e: int, slot: int, timed: bool = True, spec: QuantSpec | None = None) -> None:
        """Synchronous load of expert (m, e) at spec into slot on the calling thread, at the link's speed if timed."""
        t0 = time.perf_counter()
        self._writer.write(m, e, slot, spec, non_blocking=False)  # (2I, H) + (H, I), dequantized if packed
        if not isinstance(self.engine, CudaCopyEngine):
            hold = t0 + self.link.transfer_time(self._writer.nbytes(m, e, spec)) - time.perf_counter()
            if hold > 0 and timed:
                time.sleep(hold)
        self._event("sync_load", m, e, t0, time.perf_counter())

    def _record_transfer(self, m: int, t: Transfer) -> None:
        """Count a finished transfer's bytes and put it on the timeline."""
        if t.ok:
            self.stats.layers[m][self.phase].bytes_moved += t.nbytes
            self.stats.moved[self.phase, m, spec_label(t.spec)] += 1
        if t.t_start is not None and t.t_end is not None:
            self._event("demand" if t.urgent else "prefetch", m, t.e, t.t_start, t.t_end)

    def _settle(self, m: int) -> None:
        """Absorb the finished transfers of layer m without waiting."""
        layer = self.layers[m]
        for e, t in list(layer.inflight.items()):
            if self.engine.poll(t):
                del layer.inflight[e]
                self._record_transfer(m, t)
                if t.ok and e in layer.where:
                    layer.valid.add(e)
                elif not t.ok:  # a failed prefetch: counted; a staged one gives its slot back
                    self.stats.layers[m][self.phase].failures += int(not t.cancelled)
                    if e in layer.staged:
                        self._release(layer.staged.pop(e))

    def _reap(self, wait: bool = False) -> None:
        """Return staging slots of unneeded transfers that have finished (or wait for them)."""
        keep = []
        for slot, t in self._zombies:
            if wait:
                self.engine.wait(t)
            (self._release(slot) if self.engine.poll(t) else keep.append((slot, t)))
        self._zombies = keep

    def _drop_stale(self, m: int, needed: set[int]) -> None:
        """Layer m starts: queued prefetches it does not need are cancelled; unneeded staging goes."""
        layer = self.layers[m]
        for e in [e for e in layer.inflight if e not in needed]:
            t = layer.inflight[e]
            if self.engine.cancel(t):
                del layer.inflight[e]
                if e in layer.staged:
                    self._release(layer.staged.pop(e))
            elif e in layer.staged:  # already on the link: its slot comes back when it lands
                del layer.inflight[e]
                self._zombies.append((layer.staged.pop(e), t))
        for e in [e for e in layer.staged if e not in needed and e not in layer.inflight]:
            self._release(layer.staged.pop(e))

    def _prefetch(self, m: int, gate_input: torch.Tensor, idx_host: torch.Tensor) -> None:
        """Fate's cross-layer step: layer m+1's router on layer m's gate input, on the host."""
        n, nxt = m + 1, self.layers[m + 1]
        x = gate_input.detach().to("cpu", torch.float32)  # (T, H) the gate input goes to the host
        logits = F.linear(x, self.router_host[n])  # (T, E)
        scores = self.adapter.scores(n, logits)  # (T, E)
        cur = idx_host[0] if idx_host.shape[0] == 1 else idx_host
        predicted = self.predictor.predict(m, scores[0] if scores.shape[0] == 1 else scores, cur)
        nxt.prediction = list(predicted)
        st = self.stats.layers[n][self.phase]
        protect = frozenset(nxt.inflight) | frozenset(predicted)  # never evict a predicted expert for another
        moves: list[tuple[int, int]] = []  # (expert, slot), most probable first
        for e in predicted:
            if e in nxt.inflight or e in nxt.valid or e in nxt.staged:
                continue
            got = self._reserve(n, e, protect, for_prefetch=True)
            if got is None:
                break  # no slot left for prefetching this layer
            moves.append((e, got[0]))
        # Fate: in prefill, the least popular share of the experts sent ahead travels at low precision
        n_low = self.quant.prefill_low_count(len(moves)) if self.quant is not None and self.phase == "prefill" else 0
        for i, (e, slot) in enumerate(moves):
            reason = "prefill_low" if i >= len(moves) - n_low else "prefetch"
            self._submit(n, e, slot, urgent=False, spec=self._spec(n, reason))
            nxt.prefetched.add(e)
            st.prefetch_issued += 1

    def _event(self, kind: str, m: int, e: int, t0: float, t1: float) -> None:
        tl = getattr(getattr(self, "stats", None), "timeline", None)
        if tl is not None and self.config.timeline and len(tl) < self.config.timeline_max_events:
            tl.append((kind, m, e, t0 - self._t0, t1 - self._t0))

    # --- public -------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero every counter and the timeline (the cache contents stay)."""
        self.stats.layers = [{p: PhaseStats() for p in PHASES} for _ in self.layers]
        self.stats.timeline = []
        self.stats.forward_s = {p: [] for p in PHASES}
        self.stats.moved = Counter()
        self._t0 = time.perf_counter()

    def device_tensors(self) -> list[torch.Tensor]:
        """The device tensors the runtime allocated (the slots; packed: the pool and the fp scratch)."""
        if self.packed_slots is not None:
            return self.packed_slots.tensors()
        return [self.gate_up_slots, self.down_slots]

    def device_bytes(self) -> int:
        """Bytes of the runtime's slots plus the model's parameters left on the device."""
        slots = sum(t.numel() * t.element_size() for t in self.device_tensors())
        return slots + sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def threads(self) -> list[threading.Thread]:
        """Worker threads of the transfer engine."""
        return list(getattr(self.engine, "threads", []))

    def describe(self) -> dict:
        """Setup summary: preset, link, store, budget plan and slots per layer."""
        return {"preset": self.config.name, "link": self.stats.link, "store": self.stats.store,
                "budget_bytes": self.plan.budget_bytes, "min_budget_bytes": self.plan.min_budget_bytes,
                "cache_total": self.plan.cache_total, "slots_per_layer": list(self.slots_per_layer),
                "staging_slots": self.n_staging, "layer_compute_s": self.layer_compute_s,
                "quant": self.config.quant, "slot_expert_bytes": self.slot_expert_bytes,
                "device_slot_bytes": sum(t.numel() * t.element_size() for t in self.device_tensors())}

    def close(self, restore: bool = True) -> None:
        """Stop the transfer worker(s), unplug from the model; restore=True puts the fused experts back."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        for h in self._hooks:
            h.remove()
        for m in range(self.adapter.num_moe_layers):
            del self.adapter.experts_module(m)._fate_offloaded
        self.gate_up_slots = self.down_slots = self.packed_slots = None  # the slots go before the fused tensors
        if restore:
            self._restore_fused_experts()
            self.model.set_experts_implementation(self._prev_impl)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.engine.close()
        except Exception:
            pass


class StepwiseForward(nn.Module):
    """`model(input_ids=[B, T])` run one token at a time with the KV cache, so every position is a
    decode step of an offloaded model (prefetch, cache and on-demand precisions as in generation);
    for teacher-forced quality of the decode-time mix with `quant.quality_report`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, **_) -> "StepwiseOutput":
        """Logits [B, T, V] of input_ids [B, T], computed as T decode steps."""
        cache, steps = None, []
        for t in range(input_ids.shape[1]):
            out = self.model(input_ids=input_ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = out["cache"]
            steps.append(out.logits)  # (B, 1, V)
        return StepwiseOutput(torch.cat(steps, dim=1))  # (B, T, V)


@dataclass
class StepwiseOutput:
    """What `StepwiseForward` returns: the logits, like a transformers output."""

    logits: torch.Tensor  # (B, T, V)


def spec_label(spec: QuantSpec | None) -> str:
    """A short name of a transfer precision for counters: 'fp', 'int4/g64', ..."""
    return "fp" if spec is None else f"int{spec.bits}/g{spec.group_size}" + ("/hqq" if spec.refine else "")


@torch.no_grad()
def calibrate_layer_time(model: nn.Module, steps: int = 12) -> float:
    """Median seconds of one decoder layer in a batch-1 decode step of the model as it is now."""
    device = next(model.parameters()).device
    ids = torch.zeros(1, 8, dtype=torch.long, device=device)
    cache = model(input_ids=ids, use_cache=True)["cache"]
    nxt, times = ids[:, -1:], []
    for _ in range(max(2, steps)):
        t0 = time.perf_counter()
        model(input_ids=nxt, cache=cache, use_cache=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] / len(getattr(model, "model", model).layers)


def offload(model: nn.Module, config: OffloadConfig | None = None) -> Runtime:
    """Offload model's routed experts per config (default: the `fate` preset) and return the Runtime."""
    return Runtime(model, config or OffloadConfig.preset("fate"))
