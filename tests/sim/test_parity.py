"""One cache, three drivers: the runtime and the simulator agree exactly on an instant link.

The runtime really moves bytes (an `InstantEngine` engine that copies inside submit); the
simulator replays a trace recorded by `record_trace` on the un-offloaded model. Both drive the
same `cache.ExpertCache` and `step.run_layer`, so their per-layer counters must be identical.
Quantized presets are left out on purpose: they change the model's routing, so a trace of the
plain model is not what they run (a trace of the quantized model would be).
"""
import pytest
import torch
from helpers import embedded_models

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.profiles import COMPUTE_PROFILES
from fate_lab.hardware.setups import Hardware
from fate_lab.model.adapters import adapt
from fate_lab.model.record import record_trace
from fate_lab.offloading.runtime import offload
from fate_lab.policy.registry import POLICIES
from fate_lab.sim.simulate import SimClock, SimMover, Simulator, check_trace, simulate, trace_steps

KEYS = ("calls", "uses", "hits", "late", "misses", "host", "prefetch_issued", "prefetch_useful", "prefetch_wasted",
        "predicted", "predicted_used", "bytes_moved", "filled")
PRESETS = OffloadConfig.preset_names()
HW = Hardware(COMPUTE_PROFILES["qwen15_moe_rtx3090"], None)  # the compute profile does not matter here


def _counts(stats) -> list[dict]:
    return [{(p, k): getattr(layer[p], k) for p in ("prefill", "decode") for k in KEYS} for layer in stats.layers]


@torch.no_grad()
def _greedy(model, prompt: list[int], new_tokens: int) -> None:
    """Prefill + new_tokens - 1 greedy decode forwards, as record_trace runs them (through any EOS)."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    for _ in range(new_tokens - 1):
        nxt = out.logits[:, -1:].argmax(-1)  # (1, 1)
        out = model(input_ids=nxt, cache=out.cache, use_cache=True)


def _check(model, prompts: list[list[int]], new_tokens: int, budgets: list[int], learned: bool = False,
           router=None) -> None:
    """learned: also the presets whose learned probes only the embedded model ships (fate_learned); router: the
    model's own routers, carried to the simulator (a router the trace's weights cannot reproduce)."""
    trace = record_trace(model, None, prompts, decode_tokens=new_tokens - 1, progress=False)
    shape = ModelShape.from_adapter(adapt(model))
    configs = [(n, {}) for n in PRESETS if learned or OffloadConfig.preset(n).predictor != "learned_gate"]
    configs += [("fate", {"replacement": r}) for r, p in POLICIES.items() if not p.reads_future]  # every policy
    configs += [("fate", {"replacement": "router_ema", "prefetch_value": True}),  # a policy reading the router
                ("fate", {"prefetch_value": True, "prefetch_depth": 2}),  # prefetch by value, two layers ahead
                ("host_compute", {"prefetch_value": True, "host_fill": True})]  # the value cache with host fill
    for name, over in configs:
        for slots in budgets:
            cfg = OffloadConfig.preset(name, link="instant", slots=slots, **over)
            with offload(model, cfg) as rt:
                for p in prompts:
                    _greedy(model, p, new_tokens)
                real = _counts(rt.stats)
                real_slots = list(rt.slots_per_layer)
            sim = simulate(trace, cfg, HW, shape, router=router)
            assert sim.slots_per_layer == real_slots, (name, slots)
            for m, (r, s) in enumerate(zip(real, _counts(sim), strict=True)):
                diff = {k: (r[k], s[k]) for k in r if r[k] != s[k]}
                assert not diff, f"{name} slots={slots} layer {m}: runtime vs simulator {diff}"


@pytest.mark.parametrize("model_name", embedded_models())
def test_simulator_counts_equal_runtime_counts_on_the_embedded_model(model_name, embedded_model):
    model, tok = embedded_model(model_name)
    a = adapt(model)
    prompts = [tok("The expert cache holds")["input_ids"], tok("In the beginning")["input_ids"]]
    _check(model, prompts, new_tokens=10, budgets=[a.num_moe_layers * a.num_experts // 2,
                                                   a.num_moe_layers * a.num_experts // 4], learned=True)


def _prompts(model) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(1, model.config.vocab_size, (7,), generator=g).tolist() for _ in range(2)]


# olmoe, mixtral: softmax; gpt_oss: a router with a logit bias (recorded in the trace), transposed biased experts;
# deepseek_v3: sigmoid, groups, a correction bias; nemotron_h: experts without a gate
@pytest.mark.parametrize("family", ["olmoe", "mixtral", "gpt_oss", "deepseek_v3", "nemotron_h"])
def test_simulator_counts_equal_runtime_counts_on_other_families(family, tiny_models):
    model = tiny_models(family, seed=1)
    a = adapt(model)
    assert a.host_routers().is_linear(0)  # the trace's router weights (and biases) reproduce it
    _check(model, _prompts(model), new_tokens=8, budgets=[a.num_moe_layers * 2, a.num_moe_layers * a.num_experts // 2])


def test_a_one_token_prompt_is_a_prefill_in_the_trace_the_runtime_and_the_simulator(tiny_models):
    """One phase rule: the forward that starts the KV cache is the prefill, a 1-token prompt's too. Before it, the
    trace called that forward prefill and both drivers decode, so the TTFT came out NaN."""
    model = tiny_models("olmoe", seed=1)
    a = adapt(model)
    prompts = [[p[0]] for p in _prompts(model)]  # two 1-token prompts
    trace = record_trace(model, None, prompts, decode_tokens=3, progress=False)
    assert (trace.phase == 0).sum().item() == len(prompts)  # the trace: one prefill row per prompt
    cfg = OffloadConfig.preset("lru", link="instant", slots=a.num_moe_layers * 2)
    with offload(model, cfg) as rt:
        for p in prompts:
            _greedy(model, p, 4)
        real = rt.stats
    sim = simulate(trace, cfg, HW, ModelShape.from_adapter(a))
    for stats in (real, sim):
        assert stats.layers[0]["prefill"].calls == len(prompts) and stats.layers[0]["decode"].calls == 3 * len(prompts)
        assert stats.ttft_s == stats.ttft_s and stats.ttft_s > 0  # a number, not NaN
    _check(model, prompts, new_tokens=4, budgets=[a.num_moe_layers * 2])


@pytest.mark.parametrize("family", ["gemma4_text", "zaya"])
def test_a_router_the_trace_cannot_reproduce_is_carried_or_refused(family, tiny_models):
    """Gemma 4 normalises and scales its gate input before the projection, ZAYA routes with an MLP: their traces'
    weights cannot reproduce them. The simulator refuses to predict from such a trace, naming what to pass, and
    with the model's own routers carried it counts what the runtime counts."""
    model = tiny_models(family, seed=1)
    a = adapt(model)
    trace = record_trace(model, None, _prompts(model), decode_tokens=3, progress=False)
    assert trace.meta["router_linear"] is False
    with pytest.raises(ValueError, match=r"host_routers\(\).*simulate\(\.\.\., router=\.\.\.\)"):
        simulate(trace, OffloadConfig.preset("fate", link="instant", slots=4), HW, ModelShape.from_adapter(a))
    _check(model, _prompts(model), new_tokens=8, budgets=[a.num_moe_layers * 2], router=a.host_routers())


def test_trace_steps_group_a_prompts_prefill():
    from fate_lab.model.trace import from_routing_array

    tr = from_routing_array(torch.zeros(7, 1, 1, dtype=torch.int64), num_experts=2,
                            phase=[0, 0, 0, 1, 1, 0, 1], prompt_id=[0, 0, 0, 0, 0, 1, 1])
    assert trace_steps(tr) == [(0, 3), (3, 4), (4, 5), (5, 6), (6, 7)]


class _Context:
    """The driver side a SimMover sees (the precision rule and a `core.recorder.Recorder`), recording what it is
    told."""

    phase = "decode"

    def __init__(self):
        self.landed_bytes, self.events, self.stalls = [], [], []

    def spec(self, m, reason):
        return None

    def landed(self, m, nbytes, spec):
        self.landed_bytes.append(nbytes)

    def event(self, *ev):
        self.events.append(ev)

    def stall(self, m, e, w0, w1):
        self.stalls.append(w1 - w0)

    def prefetch_window_s(self):
        return None


def test_sim_link_queue_by_hand():
    """1000 bytes at 1e6 B/s = 1 ms each; urgent loads jump queued prefetches; started ones cannot be cancelled."""
    from fate_lab.hardware.links import LinkProfile

    ctx, clock = _Context(), SimClock()
    shape = ModelShape(1, 1, 4, 1, 10, 25, torch.float32, 0, 0)  # one expert: 3 x 10 x 25 x 4 B = 3000 B
    link = SimMover(ctx.spec, ctx, clock, LinkProfile("hand", 3e6, 0.0), COMPUTE_PROFILES["qwen15_moe_rtx3090"],
                   shape)
    p1 = link.submit(0, 1, 0, False, "prefetch")  # starts at 0, ends 1 ms
    p2 = link.submit(0, 2, 1, False, "prefetch")  # queued
    clock.now = 0.0005
    u = link.submit(0, 3, 2, True, "miss")  # jumps p2: 1 -> 2 ms
    assert link.backlog_s() == pytest.approx(0.0025)  # 0.5 ms left of p1 + u + p2
    assert not link.cancel(p1) and link.poll(p1) is None
    assert link.wait(0, 3, u) and clock.now == pytest.approx(0.002) and ctx.stalls == [pytest.approx(0.0015)]
    assert (p1.start, p1.end, u.start, u.end) == (0.0, 0.001, 0.001, pytest.approx(0.002))
    assert link.cancel(p2) is False  # the link reached it at 2 ms, when u ended
    assert link.poll(p2) is None and link.wait(0, 2, p2) and clock.now == pytest.approx(0.003)
    assert ctx.landed_bytes == [3000, 3000]  # u and p2 were observed landing; p1 never


CORE_CONFIGS = [("fate", {}), ("fate_quant", {}), ("host_compute", {}), ("static_host", {}), ("all_resident", {}),
                ("drop_low", {}), ("lru", {"replacement": "lrfu"}), ("fate", {"allocation": "uniform"}),
                ("fate", {"prefetch_value": True, "prefetch_depth": 2}), ("eap", {}),
                ("fate_quant", {"prefetch_value": True, "prefetch_low": True}),
                ("host_compute", {"prefetch_value": True, "host_fill": True})]


# qwen2_moe: gated experts without biases; gpt_oss: biases beside every expert (full precision in packed slots,
# counted alike by ModelShape, core/sizing.py and the slots); nemotron_h: up_proj only (I rows, no gate)
BUILD_FAMILIES = {"qwen2_moe": {"moe_intermediate_size": 64}, "gpt_oss": {"intermediate_size": 64},
                  "nemotron_h": {"moe_intermediate_size": 64}}  # INT4/INT2 groups of 64 fit their experts


@pytest.mark.parametrize("family", list(BUILD_FAMILIES))
@pytest.mark.parametrize("name,over", CORE_CONFIGS,
                         ids=[n + "".join(f"-{v}" for v in o.values()) for n, o in CORE_CONFIGS])
def test_runtime_and_simulator_are_built_by_one_code_path(name, over, family, tiny_models):
    """One config, one shape, one link: the runtime and the simulator describe the same build (plan, slots per
    layer, pools, slot bytes, precision policy, predictor and rule, miss rule, placement, host time, link), and the
    runtime's slots hold exactly the bytes the plan counted."""
    model = tiny_models(family, seed=3, **BUILD_FAMILIES[family])
    ad = adapt(model)  # adapt() refuses a model while it is offloaded
    shape, expert_bytes = ModelShape.from_adapter(ad), ad.bytes_per_expert()
    cfg = OffloadConfig.preset(name, slots=6, link="qwen15_moe_rtx3090_pcie3", layer_compute_s=1e-3, **over)
    with offload(model, cfg) as rt:
        built_rt = rt.core.describe()
        per_slot = rt.slots.slot_bytes if rt.packed_slots is not None else rt.slots.fp_nbytes()
        assert per_slot == rt.core.slot_bytes and rt.expert_bytes == expert_bytes
    sim = Simulator(cfg, Hardware.scaled("qwen15_moe_rtx3090_pcie3", layer_s=1e-3,
                                         compute=COMPUTE_PROFILES["qwen15_moe_rtx3090"]), shape)
    built_sim = sim.core.describe()
    assert built_rt.keys() == built_sim.keys()
    diff = {k: (built_rt[k], built_sim[k]) for k in built_rt if built_rt[k] != built_sim[k]}
    assert not diff, diff
    assert rt.core is not sim.core and type(rt.core) is type(sim.core)


def test_check_trace_refuses_a_trace_of_another_shape():
    from fate_lab.model.trace import from_routing_array

    tr = from_routing_array(torch.tensor([[[0, 15], [2, 3]]] * 5), num_experts=16)  # distinct ids per row
    with pytest.raises(ValueError, match=r"16 experts per layer \(ids up to 15\), the shape has 8"):
        check_trace(tr, OffloadConfig.preset("lru", slots=4), ModelShape(2, 2, 8, 2, 8, 8, torch.float32, 0, 0))
    with pytest.raises(ValueError, match=r"16 experts per layer \(ids up to 15\), the shape has 64"):  # too many
        check_trace(tr, OffloadConfig.preset("lru", slots=4), ModelShape(2, 2, 64, 2, 8, 8, torch.float32, 0, 0))
    with pytest.raises(ValueError, match="2 MoE layers x top-2, the shape 3 x top-2"):
        check_trace(tr, OffloadConfig.preset("lru", slots=4), ModelShape(3, 3, 16, 2, 8, 8, torch.float32, 0, 0))
