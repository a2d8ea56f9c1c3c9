"""Cache replay: hand-counted hits, compulsory misses, Belady as a lower bound, sweep speed."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_policies import LRU

from fate_lab.policy.allocation import ShallowFavoringAllocation, lru_miss_curves
from fate_lab.policy.rules import TopK, TopKPlus
from fate_lab.sim.replay import miss_curves, predictions_from_rule, replay, sweep


def test_replay_with_prefetch_by_hand():
    # (layer 0, layer 1) per token: (0, 1), (0, 2), (0, 2); one slot per layer, LRU
    ex = torch.tensor([[[0], [1]], [[0], [2]], [[0], [2]]])
    preds = [[None, [1]], [None, [3]], [None, [2]]]
    r = replay(ex, slots_per_layer=[1, 1], policy="lru", predictions=preds, phase=torch.tensor([0, 1, 1]),
               expert_bytes=10)
    # layer 0: miss, hit, hit.
    # layer 1: t0 prefetch 1 -> hit (useful); t1 prefetch 3 evicts 1, true 2 misses and evicts 3
    # (wasted); t2 prediction 2 already resident -> hit.
    o = r.overall
    assert (o["uses"], o["hits"], o["misses"]) == (6, 4, 2)
    assert (o["demand_loads"], o["prefetch_loads"], o["prefetch_useful"], o["prefetch_wasted"]) == (2, 2, 1, 1)
    assert o["bytes_moved"] == 40  # 2 demand loads + 2 prefetches of 10 bytes
    assert o["hit_rate"] == pytest.approx(4 / 6)
    assert o["hit_rate_prefill"] == pytest.approx(1 / 2)  # t0: layer 0 miss, layer 1 hit
    assert o["hit_rate_decode"] == pytest.approx(3 / 4)
    assert [p["hits"] for p in r.per_layer] == [2, 2]
    assert r.per_layer[1]["slots"] == 1


def test_prefetch_does_not_evict_its_own_set_and_skips_what_does_not_fit():
    ex = torch.tensor([[[5]]])
    r = replay(ex, slots_per_layer=[2], policy="lru", predictions=[[[1, 2, 5]]])
    # 1 and 2 fill both slots; 5 cannot evict them (same predicted set): skipped, then 5 misses;
    # the token used neither 1 nor 2: both prefetches were wasted (the runtime's definition)
    assert (r.overall["prefetch_loads"], r.overall["misses"], r.overall["prefetch_wasted"]) == (2, 1, 2)


def test_replay_without_phase_reports_none():
    r = replay(torch.tensor([[[0]]]), slots_per_layer=[1])
    assert r.overall["hit_rate_prefill"] is None and r.overall["hit_rate"] == 0.0


def test_belady_beats_lru_by_hand():
    ex = torch.tensor([1, 2, 3, 1, 2]).reshape(5, 1, 1)
    # Belady: 1m 2m 3m (evicts 2: used later than 1) 1h 2m -> 4 misses; LRU: all 5 miss
    assert replay(ex, slots_per_layer=[2], policy="belady").overall["misses"] == 4
    assert replay(ex, slots_per_layer=[2], policy="lru").overall["misses"] == 5
    assert replay(ex, slots_per_layer=[2], policy=LRU).overall["misses"] == 5  # a factory works too


def traces(max_e=6):
    return st.integers(1, 3).flatmap(
        lambda k: st.lists(
            st.lists(st.lists(st.integers(0, max_e - 1), min_size=k, max_size=k, unique=True), min_size=2, max_size=2),
            min_size=1, max_size=40,
        )
    )


@settings(max_examples=120, deadline=None)
@given(trace=traces(), cap=st.integers(0, 6))
def test_belady_never_misses_more(trace, cap):
    ex = torch.tensor(trace)  # (N, L=2, k)
    best = replay(ex, slots_per_layer=[cap, cap], policy="belady").overall["misses"]
    for name in ("lru", "lfu", "arc", "lrfu"):
        assert best <= replay(ex, slots_per_layer=[cap, cap], policy=name).overall["misses"], name


@settings(max_examples=60, deadline=None)
@given(trace=traces())
def test_capacity_e_has_only_compulsory_misses(trace):
    ex = torch.tensor(trace)
    distinct = sum(len(set(ex[:, l].reshape(-1).tolist())) for l in range(2))
    for name in ("lru", "lfu", "arc", "lrfu", "belady"):
        r = replay(ex, slots_per_layer=[6, 6], policy=name)
        assert r.overall["misses"] == distinct and r.overall["hits"] + r.overall["misses"] == r.overall["uses"]


@settings(max_examples=60, deadline=None)
@given(trace=traces(), cap=st.integers(0, 6))
def test_lrfu_limits(trace, cap):
    ex = torch.tensor(trace)

    def misses(policy, **kw):
        return replay(ex, slots_per_layer=[cap, cap], policy=policy, policy_kw=kw).overall["misses"]

    assert misses("lrfu", lam=1.0) == misses("lru")  # lam >= 1 is exactly LRU
    assert misses("lrfu", lam=0.0) == misses("lfu")  # lam = 0 is perfect LFU


def test_oracle_predictions_hit_everything_after_prefetch():
    ex = torch.tensor([[[0], [1]], [[0], [2]], [[0], [3]]])
    preds = [[None, [int(ex[t, 1, 0])]] for t in range(3)]
    r = replay(ex, slots_per_layer=[1, 1], predictions=preds)
    assert r.per_layer[1]["hit_rate"] == 1.0 and r.per_layer[1]["demand_loads"] == 0


def test_predictions_from_rule():
    scores = torch.tensor([[[0.1, 0.6, 0.3]], [[0.5, 0.2, 0.3]]])  # (N=2, L-1=1, E=3)
    assert predictions_from_rule(scores, TopK(2)) == [[None, [1, 2]], [None, [0, 2]]]


def test_miss_curves_match_lru_stack_distances():
    g = torch.Generator().manual_seed(1)
    ex = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(240)]).reshape(80, 3, 2)
    # the stack-distance curve updates recency in the input order; the replay (the runtime's order)
    # touches a token's hits before its misses, so curves agree exactly at 0 slots and at E slots and
    # within a few misses in between (an approximation, documented in lru_miss_curves)
    a, b = miss_curves(ex, 8), lru_miss_curves(ex, 8)
    for ca, cb in zip(a, b, strict=True):
        assert ca[0] == cb[0] and ca[-1] == cb[-1]
        assert all(abs(x - y) <= 0.02 * 160 for x, y in zip(ca[2:], cb[2:], strict=True))


def _skewed_trace(N, L, k, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    pop = torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample((L,))  # uses the global RNG
    return torch.stack([torch.multinomial(pop[l].expand(N, E), k, generator=g) for l in range(L)], 1)


def test_sweep_matches_replay():
    torch.manual_seed(0)
    N, L, k, E = 2000, 8, 4, 60
    ex = _skewed_trace(N, L, k, E)
    scores = torch.softmax(torch.randn(N, L - 1, E) + 3 * torch.nn.functional.one_hot(ex[:, 1:, 0], E), -1)
    preds = predictions_from_rule(scores, TopKPlus(4, 1))
    phase = (torch.arange(N) % 10 != 0).long()
    out = sweep(ex, boundaries=range(L + 1), budgets=[24 * i for i in range(1, 11)], num_experts=E, policy="arc",
                predictions=preds, phase=phase)
    assert len(out["hit_rate"]) == 90  # speed: benchmarks/bench_replay_speed.py, not asserted here
    i = 37  # boundary 3, budget 24 * 8
    slots = ShallowFavoringAllocation(3).allocate(192, L, E)
    r = replay(ex, slots_per_layer=slots, policy="arc", predictions=preds, phase=phase)
    assert (out["boundary"][i], out["cache_total"][i], out["slots"][i]) == (3, 192, slots)
    assert out["hit_rate"][i] == r.overall["hit_rate"] and out["bytes_moved"][i] == r.overall["bytes_moved"]


def test_prefetch_buffer_stages_what_the_cache_cannot_take():
    # one layer, no cache slots. Token 0 uses expert 1, token 1 uses expert 2. Predictions: [1, 3]
    # then [3]. With a staging buffer of 1: token 0 stages 1 (used: hit), 3 does not fit the buffer;
    # token 1 stages 3 (unused: wasted), 2 is a miss.
    experts = torch.tensor([[[1]], [[2]]])
    preds = [[[1, 3]], [[3]]]
    r = replay(experts, slots_per_layer=[0], policy="lru", predictions=preds, prefetch_buffer=1)
    assert (r.overall["hits"], r.overall["misses"]) == (1, 1)
    assert (r.overall["prefetch_loads"], r.overall["prefetch_useful"], r.overall["prefetch_wasted"]) == (2, 1, 1)
    assert r.overall["demand_loads"] == 1
    r0 = replay(experts, slots_per_layer=[0], policy="lru", predictions=preds)  # no buffer: nothing lands
    assert (r0.overall["hits"], r0.overall["prefetch_loads"]) == (0, 0)


def test_replay_accepts_a_trace_an_int_slot_count_and_a_phase_name():
    from fate_lab.model.trace import from_routing_array

    ex = torch.tensor([[[0, 1]], [[1, 2]], [[0, 1]]])
    tr = from_routing_array(ex, num_experts=3, phase=[0, 1, 1])
    a = replay(tr, slots_per_layer=2, policy="lru")
    b = replay(ex, slots_per_layer=[2], policy="lru", phase=torch.tensor([0, 1, 1]))
    assert a.overall == b.overall and a.overall["hit_rate_prefill"] == 0.0
    assert replay(ex, slots_per_layer=2, phase="decode").overall["uses_prefill"] == 0
    with pytest.raises(ValueError, match="phase"):
        replay(ex, slots_per_layer=2, phase="warmup")
    with pytest.raises(ValueError, match="slots_per_layer"):
        replay(ex, slots_per_layer=[2, 2])


def test_replay_follows_the_runtime_order_hits_before_misses():
    """Token 2 uses (2, 0): 0 is resident, 2 is not. The runtime computes the hit first, so LRU sees
    0 touched before 2 is admitted; with 2 slots the victim of 2 is then 1, not 0 (hand count)."""
    ex = torch.tensor([[[0, 1]], [[2, 0]], [[0, 1]]])
    r = replay(ex, slots_per_layer=[2], policy="lru")
    # t0: 0, 1 miss. t1: 0 hit (touched), 2 misses and evicts 1. t2: 0 hit, 1 misses.
    assert (r.overall["hits"], r.overall["misses"]) == (2, 4)


def test_replay_equals_the_simulator_on_an_instant_link():
    """Two drivers of one cache: the per-layer replay and the multi-layer simulator agree on decode."""
    from fate_lab.core.config import OffloadConfig
    from fate_lab.core.shape import ModelShape
    from fate_lab.hardware.profiles import COMPUTE_PROFILES
    from fate_lab.hardware.setups import Hardware
    from fate_lab.model.trace import from_routing_array
    from fate_lab.sim.simulate import simulate

    torch.manual_seed(3)
    N, L, k, E = 300, 4, 2, 8
    tr = from_routing_array(_skewed_trace(N, L, k, E, seed=3), num_experts=E)
    shape = ModelShape(L, L, E, k, 8, 8, torch.float32, 0, 0)
    for name in ("lru", "arc", "lfu"):
        cfg = OffloadConfig(name, slots=10, predictor=None, allocation="uniform", replacement=name)
        sim = simulate(tr, cfg, Hardware(COMPUTE_PROFILES["qwen15_moe_rtx3090"], None), shape)
        rep = replay(tr, slots_per_layer=sim.slots_per_layer, policy=name)
        assert [s["decode"].hits for s in sim.layers] == [p["hits"] for p in rep.per_layer], name
        assert [s["decode"].misses for s in sim.layers] == [p["demand_loads"] for p in rep.per_layer], name
        rep2 = replay(tr, cfg)  # the same config the simulator ran: same slots, same counts
        assert rep2.slots_per_layer == sim.slots_per_layer and rep2.overall == rep.overall, name


def test_sweep_and_miss_curves_give_the_same_numbers_in_parallel():
    torch.manual_seed(0)
    ex = _skewed_trace(200, 3, 2, 8, seed=5)
    a = sweep(ex, boundaries=[0, 1], budgets=[6, 12], num_experts=8, policy="arc")
    b = sweep(ex, boundaries=[0, 1], budgets=[6, 12], num_experts=8, policy="arc", n_jobs=2)
    assert a == b
    assert miss_curves(ex, 8, policy="arc") == miss_curves(ex, 8, policy="arc", n_jobs=2)


def test_replay_refuses_negative_duplicate_or_misnamed_inputs():
    import numpy as np

    with pytest.raises(ValueError, match="expert ids must lie in"):
        replay(torch.tensor([[[-1, 2]]]), slots_per_layer=2)
    with pytest.raises(ValueError, match="repeats an expert id"):
        replay(torch.tensor([[[1, 1]]]), slots_per_layer=2)
    with pytest.raises(ValueError, match="slots_per_layer=2.5: give one int for every layer"):
        replay(torch.tensor([[[1, 0]]]), slots_per_layer=2.5)
    with pytest.raises(TypeError, match="needs a config or slots_per_layer"):
        replay(torch.tensor([[[1, 0]]]))
    assert replay(torch.tensor([[[1, 0]]]), slots_per_layer=np.int64(2)).slots_per_layer == [2]  # numpy ints work
    with pytest.raises(ValueError, match="admit_prefetch='sometimes'"):
        sweep(torch.tensor([[[1, 0]]]), boundaries=[0], budgets=[2], num_experts=2, admit_prefetch="sometimes")
    with pytest.raises(ValueError, match="num_experts=3 but the trace routes to expert 7"):
        miss_curves(torch.tensor([[[7, 0]]]), 3)
    with pytest.raises(ValueError, match="above max_replays"):
        miss_curves(torch.tensor([[[7, 0]]]), 10**6)


def test_the_replay_predicts_with_the_routers_bias_and_refuses_a_router_it_cannot_reproduce(tiny_models):
    """gpt-oss's router has a logit bias: the trace's weights and biases predict what the model's own routers
    predict (the replay once dropped the bias). Gemma 4's router normalises its input first: the replay refuses
    to predict from its trace's weights and runs with the model's routers carried."""
    from fate_lab import adapt, record_trace
    from fate_lab.core.config import OffloadConfig
    from fate_lab.core.shape import ModelShape

    for family in ("gpt_oss", "gemma4_text"):
        model = tiny_models(family, seed=1)
        a = adapt(model)
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(1, model.config.vocab_size, (7,), generator=g).tolist() for _ in range(2)]
        trace = record_trace(model, None, prompts, decode_tokens=6, progress=False)
        cfg = OffloadConfig.preset("fate", slots=a.num_moe_layers * 2)
        shape = ModelShape.from_adapter(a)
        carried = replay(trace, cfg, shape=shape, router=a.host_routers())
        assert carried.overall["prefetch_loads"] > 0
        if family == "gpt_oss":
            assert trace.router_biases is not None and any(b.abs().sum() > 0 for b in trace.router_biases)
            assert replay(trace, cfg, shape=shape).per_layer == carried.per_layer
        else:
            with pytest.raises(ValueError, match="router"):
                replay(trace, cfg, shape=shape)


@pytest.mark.parametrize("call", ["replay", "sweep", "miss_curves"])
def test_a_policy_that_is_neither_a_name_nor_a_factory_is_one_clear_error(call):
    ex = torch.tensor([[[0, 1]], [[1, 2]], [[0, 2]]])  # 3 tokens x 1 layer x top-2
    run = {"replay": lambda: replay(ex, slots_per_layer=2, policy=3),
           "sweep": lambda: sweep(ex, boundaries=[0], budgets=[2], num_experts=3, policy=3),
           "miss_curves": lambda: miss_curves(ex, 3, policy=3)}[call]
    with pytest.raises(TypeError, match=r"policy=3: give a name, one of \[.*'lru'.*\], or a factory"):
        run()
