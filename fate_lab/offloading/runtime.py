"""The offloaded MoE runtime: experts really move, and `model.generate()` keeps working.

What this file is: `offload(model, config) -> Runtime` and `Runtime`, the runtime driver. It builds what
every driver builds through the driver core (`core/driver.py`: the plan, the slots per layer, the precision
policy, the cache, the predictor, the miss rule, the placement, the stats), adds the mechanisms that move
real bytes (`mechanisms.py`: host store, device slots, transfer engine; `engine_mover.py`: the cache's mover
over the engine), plugs into transformers' experts registry (`hookup.py`), and runs each experts call of MoE
layer m as one layer step with real expert math (`experts_call.py`); docs/DESIGN.md follows one call through.
It serves every experts layout the model side serves (`model.experts.expert_refusal` says why not). The
predictor reads the model's own routers on the host (`MoEAdapter.host_routers()`), fed each layer's gate input
as its router received it. A model whose experts were never loaded (`load.load_offloaded`) comes with its
checkpoint's `ExpertIndex`, and its experts are served from the files only.
Giving the model back (`close`): on a CPU, the very tensors taken; on an accelerator, the caller's own Parameters
refilled from the RAM store's host copy (never from a file: store="ssd" is refused for a model whose experts sit
in accelerator memory); after `load_offloaded`, nothing (no copy ever existed).

Quantized experts (`OffloadConfig.quant`, a `QuantPolicy` preset): the store keeps the packed copies the
policy needs; each transfer travels at the precision of its reason ("miss", "prefetch", "prefill_low" for
the least popular share of a prefill step's prefetches, "cache" for the all-resident preload); the device
slots are packed (dequantized into one full-precision scratch right before an expert computes; the plan counts
it). Where the paper is silent: an INT2 on-demand load that gets a cache slot stays cached at INT2 until evicted.
What it is not: no policy lives here, and no slot bookkeeping (that is `policy/cache.py`).
Letters: T tokens, K experts per token (top-k), H hidden, I expert intermediate, E experts.
"""
from __future__ import annotations

import threading
import time

import torch
from torch import nn

from fate_lab.core.config import OffloadConfig, refuse_plan_request
from fate_lab.core.driver import DriverCore
from fate_lab.core.shape import ModelShape
from fate_lab.core.sizing import STANDIN_SPEC
from fate_lab.hardware.setups import is_scaled, run_hardware
from fate_lab.model.adapters import MoEAdapter, adapt, is_offloaded
from fate_lab.model.checkpoint import ExpertIndex
from fate_lab.offloading import hookup
from fate_lab.offloading.engine_mover import EngineMover
from fate_lab.offloading.experts_call import ExpertsCall, ExpertSources
from fate_lab.offloading.hookup import StepwiseForward  # public here too: the runtime is where users look
from fate_lab.offloading.mechanisms import build_engine, build_slots, build_store, check_setup
from fate_lab.offloading.slots import PackedSlots
from fate_lab.offloading.store import CheckpointError
from fate_lab.offloading.transfer import CudaCopyEngine, TransferError, calibrate_layer_time
from fate_lab.policy.allocation import lru_miss_curves
from fate_lab.policy.step import LayerCall
from fate_lab.quant import PackedExpert, pack_expert

__all__ = ["OffloadConfig", "Runtime", "offload", "calibrate_layer_time", "StepwiseForward"]


class Runtime:
    """An offloaded MoE model; build it with `offload(model, config)`, end it with `close()`."""

    def __init__(self, model: nn.Module, config: OffloadConfig, index: ExpertIndex | None = None):
        """index: the checkpoint's `ExpertIndex` when the model's experts were never loaded (`load_offloaded`)."""
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"config must be an OffloadConfig (e.g. OffloadConfig.preset('fate')), got "
                            f"{type(config).__name__}")
        refuse_plan_request(config, "fate_lab.offloading.runtime.offload")
        self.model, self.config = model, config
        if is_offloaded(model):
            raise RuntimeError("this model is already offloaded by a Runtime; close() that one first")
        self.adapter: MoEAdapter = adapt(model)
        a = self.adapter
        hookup.check_servable(a)
        state = hookup.experts_state(a)
        if state == "empty" or (state == "meta" and index is None):
            raise ValueError(f"{a.family}: this model's experts are {state.replace('meta', 'on the meta device')}"
                             " (no bytes: a Runtime opened with load_offloaded was closed, one was closed with "
                             "restore=False, or the model was built without weights): open it again with "
                             "fate_lab.load_offloaded(path, config), or load it again with load_model")
        self.experts_in_memory = state == "present"
        self.device = _device_of(model, a)
        self.dtype = a.layouts[0].dtype
        check_setup(config, a.family, self.device, self.experts_in_memory)
        self.shape = ModelShape.from_adapter(a)
        self.top_k, self.num_experts = a.top_k, a.num_experts
        self.expert_bytes = self.shape.nbytes(None)  # one expert at full precision (the model's dtype), biases included
        # the scaled link's calibration needs the experts still in place
        self.layer_compute_s = None
        if is_scaled(config.link.name):
            link = config.link
            self.layer_compute_s = link.layer_compute_s or calibrate_layer_time(model, link.calibration_steps)
        native = self.device.type == "cuda" and config.link.native and config.link.name != "instant"
        self.core = DriverCore(config, self.shape, run_hardware(config.link.name, self.layer_compute_s),
                               driver="runtime", router=a.host_routers(), miss_curves=self._calibration_curves,
                               link_note=" [native CUDA]" if native else "")
        self.store = build_store(self.core, a, self.device, index)
        self.core.stats.store = self.store.describe()
        self._closed = True  # until the hook-up is complete
        self.engine = None
        self._taken = hookup.free_fused_experts(a, self.device)
        try:
            self._build_rest(model, native)
        except BaseException:
            if self.engine is not None:
                self.engine.close()
            self._give_back()
            raise

    @torch.no_grad()
    def _calibration_curves(self, prompt_tokens: int = 16, decode_tokens: int = 48) -> list[list[int]]:
        """LRU miss curves of a short greedy run from a seeded random prompt (miss_curve allocation)."""
        from fate_lab.model.record import record_trace

        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, self.model.config.vocab_size, (prompt_tokens,), generator=g).tolist()
        trace = record_trace(self.model, None, [prompt], decode_tokens=decode_tokens, progress=False)
        return lru_miss_curves(trace.experts, self.num_experts)

    def _build_rest(self, model: nn.Module, native: bool) -> None:
        """Slots, engine, cache, stand-ins, preload and the registry hook-up."""
        core, M = self.core, self.adapter.num_moe_layers
        self.slots = build_slots(core, self.dtype, self.device)
        self.link = core.hardware.link
        self.engine = build_engine(self.store, self.slots, self.link, self.device, native,
                                   self.config.link.transfer_timeout_s, self.config.store.direct)
        self._mover = EngineMover(core.spec, core.recorder, self.engine)
        self.cache = core.build_cache(self._mover)
        self.standin: list[list[PackedExpert]] | None = None
        if self.config.lossy.kind == "standin":  # HOBBIT: every expert's INT2 copy moves to the device once, up front
            self.standin = [[pack_expert(self.store.fetch(m, e), STANDIN_SPEC).to(self.device)
                             for e in range(self.num_experts)] for m in range(M)]
        self._sources = ExpertSources(self.adapter, self.slots.weights, self.store.fetch, self.standin, self.dtype,
                                      self.device, core.host_time, core.recorder)
        core.recorder.t_origin = time.perf_counter()
        self._lock = threading.Lock()  # one forward at a time; close() takes it too
        self._closing = False
        self._closed = False
        for m, e, slot in core.preload():
            self.engine.load_now(m, e, slot, core.spec(m, "cache"), timed=False)
        self._prev_impl = hookup.attach(self.adapter, self)
        self._gate_inputs: dict[int, torch.Tensor] = {}  # this forward's gate input per MoE layer (router input)
        self._hooks = [self.adapter.gate_input_hook(m, self._gate_inputs.__setitem__) for m in range(M)]
        self._hooks += [model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                       model.register_forward_hook(self._post_forward, always_call=True)]
        self._unguard = hookup.guard_forward(model, self._abort_forward)

    # --- what the rest of the suite reads ----------------------------------------------
    @property
    def stats(self):
        """The run's counters and forward times (`policy.stats.RunStats`)."""
        return self.core.stats

    @property
    def plan(self):
        """The memory plan (`policy.planner.MemoryPlan`)."""
        return self.core.plan

    @property
    def slots_per_layer(self) -> list[int]:
        """Cache slots of each MoE layer."""
        return self.core.slots_per_layer

    @property
    def slot_expert_bytes(self) -> int:
        """Bytes of one device slot."""
        return self.core.slot_bytes

    @property
    def standin_bytes(self) -> int:
        """Device bytes of the resident INT2 stand-ins (lossy='standin'), else 0."""
        return self.core.standin_bytes

    @property
    def quant(self):
        """The precision policy (`quant.QuantPolicy`), or None at full precision."""
        return self.core.quant

    @property
    def predictor(self):
        """The predictor the config names (None: no prefetching)."""
        return self.core.predictor

    @property
    def host_time(self):
        """Seconds one expert takes on the host for n tokens (`hardware.hosts.HostTime`), or None."""
        return self.core.host_time

    def spec(self, m: int, reason: str):
        """The precision expert transfers of MoE layer m travel at for reason (None: full)."""
        return self.core.spec(m, reason)

    # --- hooks around each forward ------------------------------------------------------
    def _pre_forward(self, _module, args, kwargs) -> None:
        if not self._lock.acquire(blocking=False):
            if self._closing:
                raise RuntimeError("this Runtime is being closed (close() from another thread): the model runs "
                                   "again once close() returns, or offload it again")
            raise RuntimeError("another forward is running on this offloaded model; fate_lab runs one "
                               "generate/forward at a time per Runtime (use one model per thread)")
        self._owner = threading.get_ident()
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        # the one phase rule (the simulator and the trace follow it too): prefill is the forward that starts the
        # KV cache, however many tokens it holds (a 1-token prompt too); decode is every forward that extends a
        # non-empty one (one token, or several: a speculative verify step)
        pkv = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5 names it `cache`
        past = pkv.get_seq_length() if pkv is not None and hasattr(pkv, "get_seq_length") else 0
        self.core.begin_forward("prefill" if x is not None and not past else "decode")
        self._fwd_t0 = time.perf_counter()

    def _post_forward(self, _module, _args, _out) -> None:
        if getattr(self, "_owner", None) != threading.get_ident():
            return  # this forward was refused in _pre_forward: the lock is another thread's
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.core.recorder.end_forward(time.perf_counter() - self._fwd_t0)
        finally:
            self._owner = None
            self._lock.release()

    def _abort_forward(self) -> None:
        """A forward left by Ctrl-C (or another BaseException that torch's always_call hook does not see): every
        layer's per-call state goes and the lock is released, so the runtime runs the next generate normally
        (in-flight transfers land or are absorbed by the next call; the aborted forward is not timed)."""
        if getattr(self, "_owner", None) != threading.get_ident():
            return
        try:
            for m in range(self.adapter.num_moe_layers):
                self.cache.end(m)
            self._gate_inputs.clear()
        finally:
            self._owner = None
            self._lock.release()

    # --- the experts call of MoE layer m ------------------------------------------------
    def layer_forward(self, m: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
        """Offloaded experts of MoE layer m: hidden_states [T, H], top_k_index/weights [T, K] -> [T, H]."""
        if torch.is_grad_enabled():  # generate() already runs without grad: no context to enter per layer then
            with torch.no_grad():
                return self._layer_forward(m, hidden_states, top_k_index, top_k_weights)
        return self._layer_forward(m, hidden_states, top_k_index, top_k_weights)

    def _layer_forward(self, m: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("this Runtime is closed; offload the model again to run it offloaded")
        t_call = time.perf_counter()
        call = ExpertsCall(self._sources, m, hidden_states, top_k_index, top_k_weights)

        def timed(fn):
            t0 = time.perf_counter()
            out = fn()
            self.core.recorder.event("predict", m, -1, t0, time.perf_counter())
            return out

        try:
            order = self.core.run_layer(LayerCall(
                m, call.idx_host, call, gate_input=self._gate_inputs.pop(m, hidden_states), timed=timed,
                weights=top_k_weights.detach().to("cpu") if self.core.miss_policy is not None else None))
        except (TransferError, CheckpointError):  # the link or the checkpoint is gone: give the caller its model
            try:  # back, then fail loudly (this forward holds the lock; its post-forward hook is gone with close)
                self._close(restore=True)
            finally:
                self._owner = None
                self._lock.release()
            raise
        self.core.stats.layers[m][self.core.recorder.phase].compute_s += time.perf_counter() - t_call
        return call.output(order)

    # --- public -------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero every counter and the timeline (the cache contents stay)."""
        self.core.reset_stats(time.perf_counter())

    def preload(self, m: int, experts: list[int]) -> None:
        """Make experts of MoE layer m cached and resident now (loaded synchronously, uncounted): a test and
        warm-start hook."""
        for e, slot in self.cache.preload(m, list(experts)):
            self.engine.load_now(m, e, slot, self.core.spec(m, "cache"), timed=False)

    def watch_transfers(self, fn) -> None:
        """Call fn(transfer) with every `transfer.Transfer` queued from now on (its expert, slot, precision,
        packed size, urgency, and later its timing): a tracing and test hook."""
        self._mover.observers.append(fn)

    def set_fault(self, fault) -> None:
        """Fault injection (tests, chaos runs): fault(m, e) -> True fails that transfer; an exception raised in
        it kills the transfer worker. None removes it."""
        self.engine.fault = fault

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
        """Full-precision gate_up slots [S, R, H] (the fp scratch under packed slots)."""
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

    @property
    def native(self) -> bool:
        """True when transfers run on the real CUDA copy stream."""
        return isinstance(self.engine, CudaCopyEngine)

    def describe(self) -> dict:
        """Setup summary: preset, link, store, budget plan and slots per layer."""
        return {"preset": self.config.name, "link": self.stats.link, "store": self.stats.store,
                "budget_bytes": self.plan.budget_bytes, "min_budget_bytes": self.plan.min_budget_bytes,
                "cache_total": self.plan.cache_total, "slots_per_layer": list(self.slots_per_layer),
                "staging_slots": self.n_staging, "layer_compute_s": self.layer_compute_s,
                "quant": self.config.precision.quant, "slot_expert_bytes": self.slot_expert_bytes,
                "device_slot_bytes": sum(t.numel() * t.element_size() for t in self.device_tensors()),
                "standin_bytes": self.standin_bytes}

    def close(self, restore: bool = True) -> None:
        """Stop the transfer worker(s), free the slots, unplug; restore=True gives back the caller's expert Parameters
        (on a CPU the very tensors taken; on an accelerator the same ones refilled from the RAM store's host copy, never
        a file). A model opened with `load_offloaded` has no copy: its experts stay empty, and later calls say so."""
        if self._closed:
            return
        if getattr(self, "_owner", None) == threading.get_ident():
            raise RuntimeError("close() was called from inside a forward of this offloaded model (a hook?): close it "
                               "after the forward returns")
        self._closing = True
        self._lock.acquire()  # a forward in flight on another thread ends first; none starts until we are done
        try:
            self._close(restore)
        finally:
            self._closing = False
            self._lock.release()

    def _close(self, restore: bool) -> None:
        self._closed = True
        self.engine.close()
        self.engine.release()  # its writer held the slots: a runtime kept referenced after close must not keep them
        for h in self._hooks:
            h.remove()
        self._unguard()
        no_experts = None
        if not self.experts_in_memory:
            no_experts = (f"this {self.adapter.family} model was opened with fate_lab.load_offloaded and its Runtime "
                          "is closed: its routed experts live only in the checkpoint, so the model cannot run any "
                          "more; open it again with load_offloaded(path, config)")
        elif not restore:
            no_experts = (f"this {self.adapter.family} model's Runtime was closed with restore=False: its experts were "
                          "not given back (their memory is freed), so the model cannot run any more; load it again")
        hookup.detach(self.adapter, self._prev_impl if restore else None, no_experts)
        self.slots = self._sources = None  # the slots (and the calls' handle on them) go before the experts come back
        if restore:
            self._give_back()
        else:
            self._taken = None

    def _give_back(self) -> None:
        """The experts go back into the model: the very tensors taken (CPU), the same Parameters refilled from the
        RAM store (an accelerator), or nothing where no copy exists (load_offloaded)."""
        if not self.experts_in_memory:
            return  # load_offloaded: no copy exists
        if self._taken.on_host:
            hookup.put_back(self.adapter, self._taken)
            return
        base = getattr(self.store, "base", self.store)  # the full-precision tier under packed copies
        hookup.restore_fused_experts(self.adapter, base, self._taken, self.device)

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


def _device_of(model: nn.Module, adapter: MoEAdapter) -> torch.device:
    """The device the model computes on: its experts' (unless they are on meta), else its first real parameter's."""
    t = adapter.expert(0, 0).gate_up
    if not t.is_meta:
        return t.device
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def offload(model: nn.Module, config: OffloadConfig | None = None) -> Runtime:
    """Offload model's routed experts per config (default: the `fate` preset) and return the Runtime."""
    return Runtime(model, config or OffloadConfig.preset("fate"))
