"""The offloaded MoE runtime: experts really move, and `model.generate()` keeps working.

What this file is: `offload(model, config) -> Runtime` and `Runtime`, which wires the parts:
the memory plan and per-layer slots (`planner`, `allocation`), the host store (`store`), the
device slots (`slots`), a transfer engine (`transfer`), the one expert cache (`cache`), the
predictor (`predictors`), and the HF hook-up (`hookup`: transformers' experts registry). Each
experts call of MoE layer m runs `step.run_layer` -- the same layer step the timed simulator
runs -- with real expert math; `EngineLink` is the cache's driver over the engine (it counts
bytes and stall time and sizes prefetches by the link).

Quantized experts (`OffloadConfig.quant`, a `quant.QuantPolicy` preset): the store keeps the
packed copies the policy needs; each transfer travels at the precision of its reason ("miss",
"prefetch", "prefill_low" for the least popular share of a prefill step's prefetches, "cache"
for the all-resident preload); the device slots are `slots.PackedSlots` (experts stay packed,
dequantized into one full-precision scratch right before they compute; the planner counts it).
Departures from Fate: an INT2 on-demand load that gets a cache slot stays cached at INT2 until
evicted (the paper does not say); on a scaled link with quantization the link is calibrated on
the tiny model's fp16 expert (the real setups move fp16 experts).
What it is not: no policy lives here, and no slot bookkeeping (that is `cache.py`).
Letters: T tokens, K experts per token (top-k), H hidden, I expert intermediate, E experts.
"""
from __future__ import annotations

import threading
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from fate_lab.model.adapters import MoEAdapter, adapt
from fate_lab.offloading import hookup
from fate_lab.offloading.builders import build_miss_policy, build_predictor, model_source, predictor_scores
from fate_lab.offloading.config import OffloadConfig
from fate_lab.offloading.engine_link import STALL_MIN_S, WINDOW_EMA, EngineLink
from fate_lab.offloading.hookup import StepwiseForward  # public here too, as the first version had it
from fate_lab.offloading.host import HostTime
from fate_lab.offloading.links import LINK_PROFILES, LinkProfile, resolve_link
from fate_lab.offloading.slots import (
    SCRATCH_SLOTS,
    STANDIN_SPEC,
    DeviceSlots,
    FullSlots,
    PackedSlots,
    slot_sizing,
    standin_pool_bytes,
)
from fate_lab.offloading.stats import PHASES, PhaseStats, RuntimeStats
from fate_lab.offloading.store import HostStore, PackedExpert, QuantizedStore, RamStore, SafetensorsStore
from fate_lab.offloading.transfer import (
    CudaCopyEngine,
    EmulatedLink,
    InstantLink,
    TransferEngine,
    TransferError,
    calibrate_layer_time,
)
from fate_lab.policy.allocation import lru_miss_curves
from fate_lab.policy.cache import HOST, ExpertCache
from fate_lab.policy.lossy import LOWP
from fate_lab.policy.placement import HostPlacement, host_layer_set
from fate_lab.policy.planner import plan_offload
from fate_lab.policy.predictors import Predictor, next_layer_scores
from fate_lab.policy.replacement import policy_from_name
from fate_lab.policy.step import run_layer
from fate_lab.quant import QuantPolicy, QuantSpec, expert_nbytes, quantize_expert

__all__ = ["OffloadConfig", "Runtime", "offload", "calibrate_layer_time", "StepwiseForward"]



class Runtime:
    """An offloaded MoE model; build it with `offload(model, config)`, end it with `close()`."""

    def __init__(self, model: nn.Module, config: OffloadConfig):
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig (e.g. OffloadConfig.preset('fate')), got {type(config).__name__}")
        self.model, self.config = model, config
        if hookup.is_offloaded(model):
            raise RuntimeError("this model is already offloaded by a Runtime; close() that one first")
        self.adapter: MoEAdapter = adapt(model)
        a = self.adapter
        self.device = a.experts_module(0).gate_up_proj.device
        self.dtype = a.experts_module(0).gate_up_proj.dtype
        for m in range(a.num_moe_layers):
            hookup.check_experts_module(a.experts_module(m))
        self.top_k, self.num_experts, M = a.top_k, a.num_experts, a.num_moe_layers
        self.expert_bytes = a.bytes_per_expert()  # one expert at full precision (the model's dtype)
        self.quant: QuantPolicy | None = QuantPolicy.preset(config.quant) if config.quant is not None else None
        if self.quant is not None:  # refuses a group size the experts' shapes cannot take
            for m in range(M):
                for s in self.quant.host_specs(m):
                    self._precision_nbytes(s)
        # a slot holds the largest precision that travels, packed; a packed expert computes from a scratch
        self._slot_specs, self.slot_expert_bytes, scratch_bytes = slot_sizing(
            self.quant, M, *self._expert_shapes(), self.dtype, self.expert_bytes)
        self.standin_bytes = 0
        if config.lossy == "standin":
            gu, dn = self._expert_shapes()
            if gu[1] % STANDIN_SPEC.group_size or dn[1] % STANDIN_SPEC.group_size:
                raise ValueError(f"lossy='standin' keeps INT2 copies with group size {STANDIN_SPEC.group_size}, which "
                                 f"must divide the hidden size {gu[1]} and the expert width {dn[1]}")
            self.standin_bytes = standin_pool_bytes(M, self.num_experts, gu, dn)
        scratch_bytes += self.standin_bytes  # the planner takes the resident INT2 copies off the cache budget

        # 1. the memory plan and per-layer slots (pure policies, shared with the simulator)
        self.prefetching = config.predictor is not None
        self.plan, self.slots_per_layer, self.prefetch_buffers = plan_offload(
            config, num_layers=M, num_experts=self.num_experts, top_k=self.top_k,
            slot_expert_bytes=self.slot_expert_bytes, dense_bytes=a.dense_bytes(),
            kv_bytes_per_token=a.kv_bytes_per_token(), scratch_bytes=scratch_bytes,
            miss_curves=self._calibration_curves)

        # 2. host store; the fused tensors leave the device; then slots, engine, cache, hook-up
        self.store = self._build_store()
        self.layer_compute_s = None  # the scaled link's calibration needs the experts still in place
        if config.link not in LINK_PROFILES and config.link != "instant":
            self.layer_compute_s = config.layer_compute_s or calibrate_layer_time(model, config.calibration_steps)
        self._closed = True  # until the hook-up is complete
        taken = hookup.free_fused_experts(a, self.dtype, self.device)
        # on a CPU the tensors taken are host memory already: keep them (no copy) and give exactly them back
        self._taken = taken if self.device.type == "cpu" else None
        try:
            self._build_rest(model, config)
        except BaseException:
            if getattr(self, "engine", None) is not None:
                self.engine.close()
            self._give_back()
            raise

    @torch.no_grad()
    def _calibration_curves(self, prompt_tokens: int = 16, decode_tokens: int = 48) -> list[list[int]]:
        """LRU miss curves of a short greedy run from a seeded random prompt (miss_curve allocation)."""
        from fate_lab.model.trace import record_trace

        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, self.model.config.vocab_size, (prompt_tokens,), generator=g).tolist()
        trace = record_trace(self.model, None, [prompt], decode_tokens=decode_tokens, progress=False)
        return lru_miss_curves(trace.experts, self.num_experts)

    def _build_rest(self, model: nn.Module, config: OffloadConfig) -> None:
        """Slots, link, engine, cache, predictor, stats and the registry hook-up."""
        a, M = self.adapter, self.adapter.num_moe_layers
        n_slots = sum(self.slots_per_layer) + self.top_k + 2 * self.prefetch_buffers
        if self.quant is None:
            self.slots: DeviceSlots = FullSlots.empty(n_slots, *self._expert_shapes(), self.dtype, self.device)
        else:
            self.slots = PackedSlots(*self._expert_shapes(), self._slot_specs, self.dtype, n_slots, SCRATCH_SLOTS,
                                     self.device)
            assert self.slots.slot_bytes == self.slot_expert_bytes
        # scaled links: the real setups move fp16 experts; with quantization, calibrate on the fp16 size
        link_ref = self.expert_bytes if self.quant is None else a.bytes_per_expert(torch.float16)
        self.link: LinkProfile | None = None if config.link == "instant" else \
            resolve_link(config.link, link_ref, self.layer_compute_s)
        self.engine: TransferEngine = self._build_engine()
        self.stats = RuntimeStats(
            layers=[{p: PhaseStats() for p in PHASES} for _ in range(M)],
            link=self.link.describe() + (" [native CUDA]" if isinstance(self.engine, CudaCopyEngine) else "")
            if self.link is not None else "instant (transfers land inside submit)",
            store=self.store.describe(), plan=self.plan, slots_per_layer=list(self.slots_per_layer),
        )
        self.host_time: HostTime | None = None
        placement = None
        if config.host is not None:
            gu, dn = self._expert_shapes()
            self.host_time = HostTime.for_run(config.host_profile, config.link, self.expert_bytes,
                                              2 * (gu[0] * gu[1] + dn[0] * dn[1]), self.layer_compute_s)
            placement = HostPlacement(config.host, host_layer_set(config.host, config.host_layers, M), self.host_time,
                                      0.0 if self.link is None else self.link.transfer_time(self.expert_bytes))
        self.miss_policy = build_miss_policy(config, M, self.num_experts, model_source(model) or None)
        self.standin: list[list[PackedExpert]] | None = None
        if config.lossy == "standin":  # HOBBIT: every expert's INT2 copy moves to the device once, up front
            def packed(m: int, e: int) -> PackedExpert:
                w = self.store.fetch(m, e)
                return PackedExpert(**quantize_expert({"gate_up": w.gate_up, "down": w.down}, STANDIN_SPEC))

            self.standin = [[packed(m, e).to(self.device) for e in range(self.num_experts)] for m in range(M)]
        self.cache = ExpertCache(
            self.slots_per_layer, lambda m, c: policy_from_name(config.replacement, c), self.top_k,
            self.prefetch_buffers, EngineLink(self, self.engine), self.stats.layers, cache=config.cache,
            admit_on_use=config.admit_prefetch == "on_use", link_budget=config.prefetch_budget == "link",
            placement=placement)
        assert self.cache.num_slots == n_slots
        self.predictor: Predictor | None = self._build_predictor()
        self.router_host = [a.router_weight(m).detach().to("cpu", torch.float32).clone() for m in range(M)]  # (E, H)
        self.phase = "prefill"
        self.window_s: dict[str, float] = {}  # per phase: EMA of one layer's compute time (no stall)
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()  # one forward at a time
        self._closed = False
        if config.all_resident:
            for m in range(M):
                for e, slot in self.cache.preload(m, list(range(min(self.slots_per_layer[m], self.num_experts)))):
                    self.engine.load_now(m, e, slot, self.spec(m, "cache"), timed=False)
        self._prev_impl = hookup.attach(a, self)
        self._hooks = [model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                       model.register_forward_hook(self._post_forward, always_call=True)]

    # --- construction helpers ----------------------------------------------------------
    def _expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(gate_up (2I, H), down (H, I)) of one expert."""
        a = self.adapter
        return (2 * a.expert_intermediate_size, a.hidden_size), (a.hidden_size, a.expert_intermediate_size)

    def _precision_nbytes(self, spec: QuantSpec | None) -> int:
        """Bytes of one expert at spec (packed + scales + zeros), or at full precision for None."""
        a = self.adapter
        gu, dn = self._expert_shapes()
        try:
            return expert_nbytes({"gate_up": gu, "down": dn}, spec, dtype=self.dtype)
        except ValueError as exc:
            raise ValueError(f"quant={self.config.quant!r} cannot quantize this model's experts: {exc}. Choose a "
                             f"policy whose group size divides hidden {a.hidden_size} and expert width "
                             f"{a.expert_intermediate_size}") from exc

    def spec(self, m: int, reason: str) -> QuantSpec | None:
        """The precision expert transfers of MoE layer m travel at for reason (None: full)."""
        return None if self.quant is None else self.quant.precision_for(m, reason)

    def _build_store(self) -> HostStore:
        cfg, a = self.config, self.adapter
        pin = self.device.type == "cuda"
        if cfg.store == "ram":
            base: HostStore = RamStore.from_adapter(a, pin=pin)
        else:
            if cfg.checkpoint is None:
                raise ValueError("store='ssd' needs checkpoint=<safetensors file or folder of the model>")
            base = SafetensorsStore(cfg.checkpoint, a.moe_layers, a.num_experts, self.dtype)
            base.verify(a)  # refuse a checkpoint that is not these weights, before anything is freed
        if self.quant is None:
            return base
        return QuantizedStore(base, [self.quant.host_specs(m) for m in range(a.num_moe_layers)], pin=pin)

    def _build_predictor(self) -> Predictor | None:
        a = self.adapter
        return build_predictor(self.config, a.num_moe_layers, a.num_experts, a.hidden_size, self.top_k,
                               model_source(self.model) or None)

    def _build_engine(self) -> TransferEngine:
        if self.link is None:
            return InstantLink(self.store, self.slots)
        if self.device.type == "cuda" and self.config.native_link:
            return CudaCopyEngine(self.store, self.slots)
        return EmulatedLink(self.store, self.slots, self.link, timeout_s=self.config.transfer_timeout_s)

    # --- hooks around each forward ------------------------------------------------------
    def _pre_forward(self, _module, args, kwargs) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("another forward is running on this offloaded model; fate_lab runs one "
                               "generate/forward at a time per Runtime (use one model per thread)")
        self._owner = threading.get_ident()
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        # prefill: a forward that starts the KV cache with more than one token; decode: one token, or
        # several that extend a non-empty KV cache (a speculative verify step)
        pkv = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5 names it `cache`
        past = pkv.get_seq_length() if pkv is not None and hasattr(pkv, "get_seq_length") else 0
        self.phase = "prefill" if x is not None and x.shape[1] > 1 and not past else "decode"
        self.cache.phase = self.phase
        if self.phase == "prefill" and self.predictor is not None:
            self.predictor.reset()
        if hasattr(self.predictor, "set_phase"):  # a learned gate keeps one threshold per phase
            self.predictor.set_phase(self.phase)
        self._stall_in_forward = 0.0
        self._fwd_t0 = time.perf_counter()

    def _post_forward(self, _module, _args, _out) -> None:
        if getattr(self, "_owner", None) != threading.get_ident():
            return  # this forward was refused in _pre_forward: the lock is another thread's
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dt = time.perf_counter() - self._fwd_t0
            self.stats.forward_s[self.phase].append(dt)
            layer_s = max(dt - self._stall_in_forward, 0.0) / len(getattr(self.model, "model", self.model).layers)
            old = self.window_s.get(self.phase)
            self.window_s[self.phase] = layer_s if old is None else (1 - WINDOW_EMA) * old + WINDOW_EMA * layer_s
        finally:
            self._owner = None
            self._lock.release()

    # --- the experts call of MoE layer m ------------------------------------------------
    @torch.no_grad()
    def layer_forward(self, m: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
        """Offloaded experts of MoE layer m: hidden_states [T, H], top_k_index/weights [T, K] -> [T, H]."""
        if self._closed:
            raise RuntimeError("this Runtime is closed; offload the model again to run it offloaded")
        t_call = time.perf_counter()
        T, K = top_k_index.shape
        idx_host = top_k_index.detach().to("cpu")  # (T, K)
        flat = idx_host.reshape(-1).tolist()  # (T*K,) expert per (token, k) position
        out_dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        weighted = torch.zeros(T * K, hidden_states.shape[1], dtype=out_dtype, device=hidden_states.device)  # (T*K, H)
        flat_idx, flat_w = top_k_index.reshape(-1), top_k_weights.reshape(-1)  # (T*K,)
        experts_mod = self.adapter.experts_module(m)

        def compute(e: int, slot: int) -> None:
            if slot == HOST:
                return host_compute(e)
            if slot == LOWP:
                return lowp_compute(e)
            t0 = time.perf_counter()
            gate_up, down = self.slots.weights(slot)  # (2I, H), (H, I); packed: dequantized into the scratch
            if T == 1:  # decode: expert e sits at one position k of the single token
                k = flat.index(e)
                h = experts_mod._apply_gate(F.linear(hidden_states, gate_up))  # (1, I)
                weighted[k:k + 1] = F.linear(h, down) * flat_w[k:k + 1, None]  # (1, H)
            else:
                pos = (flat_idx == e).nonzero().squeeze(1)  # (n,) flat (token, k) positions of e
                h = experts_mod._apply_gate(F.linear(hidden_states[pos // K], gate_up))  # (n, I)
                weighted[pos] = F.linear(h, down) * flat_w[pos].unsqueeze(-1)  # (n, H)
            self.event("compute", m, e, t0, time.perf_counter())

        def lowp_compute(e: int) -> None:
            """Expert e computes from its resident INT2 copy, dequantized right before use (HOBBIT's stand-in)."""
            t0 = time.perf_counter()
            q = self.standin[m][e]
            gate_up, down = q.gate_up.dequantize(self.dtype), q.down.dequantize(self.dtype)  # (2I, H), (H, I)
            k = flat.index(e)  # decode only: one token, e at one position
            h = experts_mod._apply_gate(F.linear(hidden_states, gate_up))  # (1, I)
            weighted[k:k + 1] = F.linear(h, down) * flat_w[k:k + 1, None]  # (1, H)
            self.event("compute_lowp", m, e, t0, time.perf_counter())

        def host_compute(e: int) -> None:
            """Expert e computes on the host from the store's weights; the activations go there and back.
            On a CPU-only machine the host is emulated: the expert really computes, then the call holds
            until the host profile's time for its tokens has passed."""
            t0 = time.perf_counter()
            w = self.store.fetch(m, e)  # host tensors: gate_up (2I, H), down (H, I)
            pos = (flat_idx == e).nonzero().squeeze(1).cpu()  # (n,) flat (token, k) positions of e
            x = hidden_states[(pos // K).to(hidden_states.device)].to("cpu", w.gate_up.dtype)  # (n, H) to the host
            h = experts_mod._apply_gate(F.linear(x, w.gate_up))  # (n, I)
            y = F.linear(h, w.down).to(hidden_states.device, out_dtype)  # (n, H) back to the device
            p_dev = pos.to(hidden_states.device)
            weighted[p_dev] = y * flat_w[p_dev].unsqueeze(-1)  # (n, H)
            if self.device.type == "cpu":
                hold = t0 + self.host_time(len(pos)) - time.perf_counter()
                if hold > 0:
                    time.sleep(hold)
            t1 = time.perf_counter()
            self.stats.layers[m][self.phase].host_s += t1 - t0
            self.event("host", m, e, t0, t1)

        def scores() -> torch.Tensor | None:
            return predictor_scores(self.predictor, m, hidden_states, self.router_host[m + 1],
                                    self.adapter.router_spec.scoring)

        def timed_predict(fn):
            t0 = time.perf_counter()
            out = fn()
            self.event("predict", m, -1, t0, time.perf_counter())
            return out

        low = self.quant.prefill_low_count if self.quant is not None and self.phase == "prefill" else None
        try:
            order = run_layer(self.cache, self.predictor, m, idx_host, scores, compute, self.config.popularity_order,
                              low, timed_predict, lambda: next_layer_scores(self.router_host[m], hidden_states,
                                                                            self.adapter.router_spec.scoring),
                              self.miss_policy, top_k_weights.detach().to("cpu") if self.miss_policy else None)
        except TransferError:  # the link is gone: give the caller its model back, then fail loudly
            self.close()
            raise
        self.stats.layers[m][self.phase].compute_s += time.perf_counter() - t_call
        out = weighted.view(T, K, -1).sum(dim=1)  # (T, H)
        if len(order) < len(set(flat)):  # a lossy step dropped experts: renormalise over the ones kept
            kept = torch.tensor([e in set(order) for e in flat], device=flat_w.device)  # (T*K,)
            w_all, w_kept = flat_w.sum(), (flat_w * kept).sum()
            if w_kept > 0:
                out = out * (w_all / w_kept)
        return out.to(hidden_states.dtype)

    # --- counters -------------------------------------------------------------------------
    def stall(self, m: int, e: int, w0: float, w1: float) -> None:
        """Count a wait of the compute thread for (m, e) as stall, if it was one."""
        if w1 - w0 > STALL_MIN_S:
            self.stats.layers[m][self.phase].stall_s += w1 - w0
            self._stall_in_forward += w1 - w0
            self.event("stall", m, e, w0, w1)

    def event(self, kind: str, m: int, e: int, t0: float, t1: float) -> None:
        """Append (kind, layer, expert, start, end) to the timeline (seconds since the last reset)."""
        tl = getattr(getattr(self, "stats", None), "timeline", None)
        if tl is not None and self.config.timeline and len(tl) < self.config.timeline_max_events:
            tl.append((kind, m, e, t0 - self._t0, t1 - self._t0))

    # --- public -------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero every counter and the timeline (the cache contents stay)."""
        self.stats.layers = [{p: PhaseStats() for p in PHASES} for _ in self.cache.layers]
        self.cache.stats = self.stats.layers
        self.stats.timeline = []
        self.stats.forward_s = {p: [] for p in PHASES}
        self.stats.moved = Counter()
        self._t0 = time.perf_counter()

    @property
    def layers(self):
        """Per-layer cache state (`cache.LayerState`), read-only use."""
        return self.cache.layers

    @property
    def n_staging(self) -> int:
        """Staging slots: top_k demand slots plus the two prefetch pools."""
        return self.cache.num_staging

    @property
    def packed_slots(self) -> PackedSlots | None:
        """The packed slots of a quantized runtime, else None."""
        return self.slots if isinstance(self.slots, PackedSlots) else None

    @property
    def gate_up_slots(self) -> torch.Tensor:
        """Full-precision gate_up slots [S, 2I, H] (the fp scratch under packed slots)."""
        return self.slots.gate_up_scratch if isinstance(self.slots, PackedSlots) else self.slots.gate_up

    def device_tensors(self) -> list[torch.Tensor]:
        """The device tensors the runtime allocated (the slots; packed: the pool and the fp scratch)."""
        return self.slots.tensors() if self.slots is not None else []

    def device_bytes(self) -> int:
        """Bytes of the runtime's slots plus the model's parameters left on the device."""
        slots = sum(t.numel() * t.element_size() for t in self.device_tensors()) + self.standin_bytes
        return slots + sum(p.numel() * p.element_size() for p in self.model.parameters())

    @property
    def threads(self) -> list[threading.Thread]:
        """Worker threads of the transfer engine."""
        return list(self.engine.threads)

    def describe(self) -> dict:
        """Setup summary: preset, link, store, budget plan and slots per layer."""
        return {"preset": self.config.name, "link": self.stats.link, "store": self.stats.store,
                "budget_bytes": self.plan.budget_bytes, "min_budget_bytes": self.plan.min_budget_bytes,
                "cache_total": self.plan.cache_total, "slots_per_layer": list(self.slots_per_layer),
                "staging_slots": self.n_staging, "layer_compute_s": self.layer_compute_s,
                "quant": self.config.quant, "slot_expert_bytes": self.slot_expert_bytes,
                "device_slot_bytes": sum(t.numel() * t.element_size() for t in self.device_tensors()),
                "standin_bytes": self.standin_bytes}

    def close(self, restore: bool = True) -> None:
        """Stop the transfer worker(s), unplug from the model; restore=True puts the fused experts back."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        for h in self._hooks:
            h.remove()
        hookup.detach(self.adapter, self._prev_impl if restore else None)
        self.slots = None  # the slots go before the fused tensors come back
        if restore:
            self._give_back()

    def _give_back(self) -> None:
        """The experts go back into the model: the very tensors taken (CPU), or copies from the host store."""
        if self._taken is not None:
            hookup.put_back(self.adapter, self._taken)
        else:
            hookup.restore_fused_experts(self.adapter, self.store, self.device)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except Exception as close_error:
            if exc_type is None:
                raise
            import warnings  # the error that ended the block goes on; this one must not hide it

            warnings.warn(f"closing the offloaded runtime also failed: {close_error!r}", RuntimeWarning, stacklevel=2)

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.engine.close()
        except Exception:
            pass


def offload(model: nn.Module, config: OffloadConfig | None = None) -> Runtime:
    """Offload model's routed experts per config (default: the `fate` preset) and return the Runtime."""
    return Runtime(model, config or OffloadConfig.preset("fate"))
