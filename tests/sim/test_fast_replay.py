"""The compiled replay against the uncompiled one (`ExpertCache` driven by `replay_layer_pure`, with the policy's
pure-Python reference from tests/reference_policies.py where it has one): identical counts, always.

Random traces (hypothesis: experts, top-k with repeats, capacity, staging buffer, admission mode, predicted
sets with repeats, phases) and both embedded models' traces with Fate's cross-layer predictions, for every
policy the fast path covers. The first run on a machine compiles the kernels (about a minute), later runs
load them from numba's cache.
"""
import numpy as np
import pytest
import torch
from helpers import embedded_models
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_policies import LRU, REFERENCE

from fate_lab.policy.registry import POLICIES
from fate_lab.sim.fast_replay import (
    fast_supported,
    miss_curve_fast,
    predicted_sets,
    replay_jobs_fast,
    replay_layer_fast,
)
from fate_lab.sim.replay import miss_curves, replay, replay_layer_pure, sweep

# every registered policy that reads no router probabilities (router_ema: test_compiled_policies.py and the replay()
# of the embedded traces below), with keyword variants
FAST_POLICIES = tuple(n for n, p in POLICIES.items() if not p.needs_scores)
SPECS = [(name, {}) for name in FAST_POLICIES] + [
    ("lfu", {"keep_history": False}), ("lrfu", {"lam": 0.0}), ("lrfu", {"lam": 1.0, "keep_history": False}),
    ("s3fifo", {"small_ratio": 0.3, "move_threshold": 1}), ("lirs", {"hir_ratio": 0.3}),
    ("lecar", {"seed": 7, "discount": 0.9}), ("least_stale", {"keep_history": True, "alpha": 0.5})]


def pure_counts(uses, preds, phases, name, kw, cap, buffer, k, admit):
    """The uncompiled replay's counts, with the policy's pure reference where one exists (else the compiled policy
    by name: the cache's two state machines still meet)."""
    ul = [list(map(int, row)) for row in uses]
    assert all(len(row) == k for row in ul)
    ref = REFERENCE.get(name)
    if ref is None:
        return replay_layer_pure(ul, list(phases), name, cap, policy_kw=kw, predictions=preds, buffer=buffer,
                                 admit=admit)
    factory = (lambda c: ref(c, ul)) if POLICIES[name].reads_future else (lambda c: ref(c, **kw))
    return replay_layer_pure(ul, list(phases), factory, cap, predictions=preds, buffer=buffer, admit=admit)


def csr(preds):
    offsets, ids = [0], []
    for p in preds:
        ids += p or []
        offsets.append(len(ids))
    return offsets, ids


@st.composite
def layer_traces(draw):
    E = draw(st.integers(1, 10))
    k = draw(st.integers(1, 4))
    N = draw(st.integers(1, 40))
    uses = draw(st.lists(st.lists(st.integers(0, E - 1), min_size=k, max_size=k), min_size=N, max_size=N))
    phases = draw(st.lists(st.integers(0, 1), min_size=N, max_size=N))
    preds = None
    if draw(st.booleans()):
        preds = draw(st.lists(st.one_of(st.none(), st.lists(st.integers(0, E - 1), max_size=E + 2)),
                              min_size=N, max_size=N))
    return E, k, uses, phases, preds


@settings(max_examples=150, deadline=None)
@given(trace=layer_traces(), spec=st.sampled_from(SPECS), cap=st.integers(0, 11), buffer=st.integers(0, 3),
       admit=st.sampled_from(["on_load", "on_use"]), heap_above=st.sampled_from([0, 128]))
def test_random_traces_give_identical_counts(trace, spec, cap, buffer, admit, heap_above):
    E, k, uses, phases, preds = trace
    name, kw = spec
    want = pure_counts(uses, preds, phases, name, kw, cap, buffer, k, admit)
    offsets, ids = csr(preds) if preds is not None else (None, None)
    got = replay_layer_fast(np.array(uses), phases, policy=name, capacity=cap, policy_kw=kw, pred_offsets=offsets,
                            pred_ids=ids, buffer=buffer, admit=admit, heap_above=heap_above)
    assert got == want


def test_every_policy_on_a_skewed_trace():
    """A longer trace with locality, every capacity: the state machines' rarer paths (ghost hits, demotions,
    second passes) all run here."""
    g = np.random.default_rng(3)
    E, k, N = 12, 3, 400
    pop = g.dirichlet(np.full(E, 0.4))
    uses = np.stack([g.choice(E, k, replace=False, p=pop) for _ in range(N)])
    uses[1::3] = uses[:-1:3]  # some tokens repeat the previous one
    phases = (np.arange(N) % 5 != 0).astype(int)
    preds = [list(g.choice(E, 4, replace=False)) if t % 2 else None for t in range(N)]
    offsets, ids = csr(preds)
    for name, kw in SPECS:
        for cap in range(E + 1):
            for admit, buffer in (("on_load", 0), ("on_use", 2)):
                want = pure_counts(uses, preds, phases, name, kw, cap, buffer, k, admit)
                for heap_above in (0, 128):  # the heap and the scanned array
                    got = replay_layer_fast(uses, phases, policy=name, capacity=cap, policy_kw=kw, pred_offsets=offsets,
                                            pred_ids=ids, buffer=buffer, admit=admit, heap_above=heap_above)
                    assert got == want, (name, kw, cap, admit, heap_above)


def test_lrfu_gaps_beyond_the_pow_table():
    """The kernel looks decay ** gap up in a table of 4096 gaps and calls pow() beyond: both must match."""
    g = np.random.default_rng(5)
    uses = g.integers(0, 6, size=(6000, 2))
    uses[::2500] = [7, 8]  # experts 7 and 8 come back after ~5000 references
    for cap in (2, 3, 5, 9):
        for kw in ({}, {"lam": 0.001}):
            assert replay_layer_fast(uses, policy="lrfu", capacity=cap, policy_kw=kw) == \
                pure_counts(uses, None, [1] * 6000, "lrfu", kw, cap, 0, 2, "on_load")


@pytest.mark.parametrize("model", embedded_models())
def test_embedded_model_traces_give_identical_results(model):
    from fate_lab.policy.rules import TopKPlus, cross_layer_scores
    from fate_lab.sim.replay import predictions_from_rule
    from fate_lab.study.lab import get_trace

    tr = get_trace(model, fast=True)
    N, L, k = tr.experts.shape
    E = tr.meta["num_experts"]
    scores = cross_layer_scores(tr.gate_inputs, tr.router_weights, tr.meta.get("scoring", "softmax"))
    preds = predictions_from_rule(scores, TopKPlus(k, 2))
    slots = [(l * 5) % (E // 2) + 1 for l in range(L)]
    for name, kw in [*SPECS, ("router_ema", {}), ("router_ema", {"decay": 0.5})]:
        for p, buffer, admit in ((None, 0, "on_load"), (preds, 0, "on_load"), (preds, k, "on_use")):
            a = replay(tr, slots_per_layer=slots, policy=name, policy_kw=kw, predictions=p, prefetch_buffer=buffer,
                       admit_prefetch=admit, fast=True)
            b = replay(tr, slots_per_layer=slots, policy=name, policy_kw=kw, predictions=p, prefetch_buffer=buffer,
                       admit_prefetch=admit, fast=False)
            assert a.per_layer == b.per_layer and a.overall == b.overall, (name, kw, admit)
    assert miss_curves(tr, E, policy="arc", fast=True) == miss_curves(tr, E, policy="arc", fast=False)


def test_sweep_and_miss_curves_match_the_pure_path():
    g = torch.Generator().manual_seed(2)
    ex = torch.stack([torch.randperm(10, generator=g)[:3] for _ in range(600)]).reshape(200, 3, 3)
    preds = [[None, [int(ex[t, 1, 0]), 9], [1, 2, 3]] for t in range(200)]
    kw = dict(boundaries=[0, 1, 2], budgets=[6, 12, 21], num_experts=10, policy="lirs", predictions=preds,
              phase=(torch.arange(200) % 3 != 0).long(), prefetch_buffer=1, admit_prefetch="on_use")
    assert sweep(ex, **kw, fast=True) == sweep(ex, **kw, fast=False)
    for name in ("belady", "s3fifo"):
        pure = miss_curves(ex, 10, policy=name, predictions=preds, fast=False)
        assert miss_curves(ex, 10, policy=name, predictions=preds, fast=True) == pure
        assert miss_curve_fast(ex.numpy(), 10, policy=name, predictions=predicted_sets(preds, 3), n_jobs=2) == pure


def test_replay_on_every_core_gives_the_same_counts():
    g = np.random.default_rng(8)
    ex = np.stack([[g.choice(12, 2, replace=False) for _ in range(5)] for _ in range(300)])
    for pol in ("lru", "lirs", "belady"):
        one = replay(ex, slots_per_layer=[2, 3, 4, 5, 6], policy=pol)
        assert replay(ex, slots_per_layer=[2, 3, 4, 5, 6], policy=pol, n_jobs=-1).per_layer == one.per_layer
    with pytest.raises(ValueError, match="n_jobs=0"):
        replay(ex, slots_per_layer=2, n_jobs=0)


def test_predicted_sets_round_trip():
    preds = [[None, [3, 1]], [[2], None], [None, []]]
    ps = predicted_sets(preds, 2)
    assert ps.layer_lists(0) == [None, [2], None] and ps.layer_lists(1) == [[3, 1], None, None]
    ex = torch.tensor([[[0], [1]], [[2], [3]], [[0], [1]]])
    assert replay(ex, slots_per_layer=1, predictions=ps).overall == replay(ex, slots_per_layer=1, predictions=preds,
                                                                          fast=False).overall


def test_what_the_fast_path_covers():
    assert all(fast_supported(n) for n in POLICIES)
    assert fast_supported("LRFU", {"lam": 0.1}) and not fast_supported("lrfu", {"decay": 0.9})
    assert not fast_supported(LRU)
    # a factory still works: the pure path runs
    ex = torch.tensor([1, 2, 3, 1, 2]).reshape(5, 1, 1)
    assert replay(ex, slots_per_layer=[2], policy=LRU).overall == replay(ex, slots_per_layer=[2], policy="lru").overall


def test_errors_name_the_argument():
    uses = np.array([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="router's probabilities: give probs"):
        replay_layer_fast(uses, policy="router_ema", capacity=1)
    with pytest.raises(ValueError, match="unknown replacement policy 'fifo'"):
        replay_layer_fast(uses, policy="fifo", capacity=1)
    with pytest.raises(ValueError, match="admit"):
        replay_layer_fast(uses, policy="lru", capacity=1, admit="never")
    with pytest.raises(ValueError, match="negative expert id"):
        replay_layer_fast(np.array([[0, -1]]), policy="lru", capacity=1)
    with pytest.raises(ValueError, match="phases"):
        replay_layer_fast(uses, [0, 2], policy="lru", capacity=1)
    with pytest.raises(ValueError, match="capacities"):
        replay_jobs_fast(uses[:, None], policy="lru", layers=[0], capacities=[-1])
    with pytest.raises(ValueError, match="lam"):
        replay_layer_fast(uses, policy="lrfu", capacity=1, policy_kw={"lam": -1.0})


def test_each_policy_gets_the_loop_written_out_for_it():
    # dispatch.py writes the cache's steps and driver.py's loop out per policy with only its POLICY line changed:
    # each copy must call its own policy's functions and hold the rest of the text unchanged (a copy bound to the
    # wrong policy would also fail the parity tests above, policy by policy)
    from pathlib import Path

    from fate_lab.sim.fast import dispatch

    text = dispatch.source("lru").replace("POLICY = POLICIES['lru']", 'POLICY = POLICIES["lru"]')
    text = text[:text.rindex("# written for the policy sources ")]
    for name, rec in POLICIES.items():
        loop = dispatch.loop_for(name)
        assert loop.POLICY is rec and loop.policy_admit is rec.admit and loop.policy_access is rec.access
        copy = Path(loop.__file__).read_text().replace(f"POLICY = POLICIES[{name!r}]", 'POLICY = POLICIES["lru"]')
        assert copy.startswith(text) and copy[len(text):].startswith("# written for the policy sources ")
    with pytest.raises(ValueError, match="unknown replacement policy"):
        dispatch.loop_for("mru")
