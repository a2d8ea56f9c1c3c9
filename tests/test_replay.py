"""Cache replay: hand-counted hits, compulsory misses, Belady as a lower bound, sweep speed."""
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fate_lab.allocation import ShallowFavoringAllocation, lru_miss_curves
from fate_lab.predictors import TopK, TopKPlus
from fate_lab.replacement import LRU
from fate_lab.replay import miss_curves, predictions_from_rule, replay, sweep


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
    assert o["prefetch_unused_at_end"] == 0
    assert (o["bytes_on_demand"], o["bytes_prefetch"], o["bytes_moved"]) == (20, 20, 40)
    assert o["hit_rate"] == pytest.approx(4 / 6)
    assert o["hit_rate_prefill"] == pytest.approx(1 / 2)  # t0: layer 0 miss, layer 1 hit
    assert o["hit_rate_decode"] == pytest.approx(3 / 4)
    assert [p["hits"] for p in r.per_layer] == [2, 2]
    assert r.per_layer[1]["slots"] == 1


def test_prefetch_does_not_evict_its_own_set_and_skips_what_does_not_fit():
    ex = torch.tensor([[[5]]])
    r = replay(ex, slots_per_layer=[2], policy="lru", predictions=[[[1, 2, 5]]])
    # 1 and 2 fill both slots; 5 cannot evict them (same predicted set): skipped, then 5 misses
    assert (r.overall["prefetch_loads"], r.overall["misses"], r.overall["prefetch_unused_at_end"]) == (2, 1, 1)


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
    # the stack-distance curve is exact for capacity >= k (=2)
    a, b = miss_curves(ex, 8), lru_miss_curves(ex, 8)
    assert [c[2:] for c in a] == [c[2:] for c in b]


def _skewed_trace(N, L, k, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    pop = torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample((L,))  # uses the global RNG
    return torch.stack([torch.multinomial(pop[l].expand(N, E), k, generator=g) for l in range(L)], 1)


def test_sweep_matches_replay_and_is_fast():
    torch.manual_seed(0)
    N, L, k, E = 2000, 8, 4, 60
    ex = _skewed_trace(N, L, k, E)
    scores = torch.softmax(torch.randn(N, L - 1, E) + 3 * torch.nn.functional.one_hot(ex[:, 1:, 0], E), -1)
    preds = predictions_from_rule(scores, TopKPlus(4, 1))
    phase = (torch.arange(N) % 10 != 0).long()
    t = time.perf_counter()
    out = sweep(ex, boundaries=range(10), budgets=[24 * i for i in range(1, 11)], num_experts=E, policy="arc",
                predictions=preds, phase=phase)
    elapsed = time.perf_counter() - t
    assert len(out["hit_rate"]) == 100
    assert elapsed < 30, f"10x10 sweep took {elapsed:.1f}s"
    i = 37  # boundary 3, budget 24 * 8
    slots = ShallowFavoringAllocation(3).allocate(192, L, E)
    r = replay(ex, slots_per_layer=slots, policy="arc", predictions=preds, phase=phase)
    assert (out["boundary"][i], out["cache_total"][i], out["slots"][i]) == (3, 192, slots)
    assert out["hit_rate"][i] == r.hit_rate and out["bytes_moved"][i] == r.overall["bytes_moved"]


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
