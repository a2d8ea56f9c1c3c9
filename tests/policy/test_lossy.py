"""Lossy decode steps: the miss rules by hand, their mechanism in the layer step, and their edges in the runtime.

The rules (drop, substitute, commit) change what the model computes, so the runtime tests check
what must still hold exactly: a threshold that never fires keeps the plain model's tokens; a
committed step queues no load; the stand-in is the expert the similarity table names.
"""
import pytest
import torch
from helpers import ScriptedMover, greedy, prompt_ids
from reference_policies import LRU

from fate_lab.core.config import OffloadConfig
from fate_lab.offloading.runtime import offload
from fate_lab.policy.cache import ExpertCache
from fate_lab.policy.lossy import MissPolicy
from fate_lab.policy.similarity import ExpertSimilarity
from fate_lab.policy.step import LayerCall, StepRules, run_layer


def _table(M: int, E: int, best: int) -> ExpertSimilarity:
    """A similarity table whose most similar expert to every e (other than e) is `best`, then lower ids."""
    sim = torch.full((M, E, E), -1.0)
    for e in range(E):
        for f in range(E):
            sim[:, e, f] = 1.0 if e == f else (0.5 if f == best else -0.01 * f)
    return ExpertSimilarity(sim=sim, routed=torch.ones(M, E, dtype=torch.long))


def test_miss_rules_by_hand():
    share = {1: 0.5, 2: 0.3, 3: 0.15, 4: 0.05}
    drop = MissPolicy("drop", 0.2)
    assert drop.plan(0, [2, 3, 4], share, {1}, None) == {3: None, 4: None}
    sub = MissPolicy("substitute", 0.2, _table(1, 6, best=5))
    assert sub.plan(0, [3, 4], share, {1, 5}, None) == {3: 5, 4: 5}
    assert sub.plan(0, [3, 4], share, {1, 2}, None) == {3: 1, 4: 1}  # -0.01 f: the lower id is nearer
    assert sub.plan(0, [3], share, set(), None) == {3: None}  # nothing resident: dropped
    strict = MissPolicy("substitute", 0.2, _table(1, 6, best=5), min_similarity=0.6)
    assert strict.plan(0, [3], share, {5}, None) == {3: None}
    commit = MissPolicy("commit", 0.7)
    assert commit.plan(0, [2, 3], share, {1}, topk_mass=0.6) == {2: None, 3: None}
    assert commit.plan(0, [2, 3], share, {1}, topk_mass=0.8) == {}
    with pytest.raises(ValueError, match="similarity"):
        MissPolicy("substitute", 0.1)
    with pytest.raises(ValueError, match="choose one"):
        MissPolicy("skip", 0.1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        MissPolicy("drop", 1.5)


class _Calls:
    """A compute target that notes (expert, where) for each expert the layer step dispatches."""

    def __init__(self, calls: list):
        self.calls = calls

    def on_device(self, e, slot):
        self.calls.append((e, slot))

    def on_host(self, e):
        self.calls.append((e, "host"))

    def from_standin(self, e):
        self.calls.append((e, "standin"))


def test_one_dispatch_sends_each_expert_where_the_cache_put_it():
    from fate_lab.policy.cache import HOST
    from fate_lab.policy.lossy import LOWP
    from fate_lab.policy.step import dispatch

    calls = []
    for e, slot in ((1, 7), (2, HOST), (3, LOWP), (4, 0)):
        dispatch(_Calls(calls), e, slot)
    assert calls == [(1, 7), (2, "host"), (3, "standin"), (4, 0)]


def test_layer_step_computes_the_stand_in_from_its_slot():
    """One decode call of a layer with expert 5 cached: misses 3 and 4 (low weight) compute from 5's slot,
    before anything else, and no transfer is queued for them; 1 (high weight) is loaded."""
    link = ScriptedMover(instant=True)
    cache = ExpertCache([2], lambda m, c: LRU(c), top_k=4, prefetch_buffers=0, mover=link)
    cache.phase = "decode"
    [(e5, slot5)] = cache.preload(0, [5])
    calls = []
    rules = StepRules(None, None, miss_policy=MissPolicy("substitute", 0.2, _table(1, 6, 5)))
    order = run_layer(cache, rules, LayerCall(0, torch.tensor([[1, 5, 3, 4]]), _Calls(calls),
                                              weights=torch.tensor([[0.5, 0.3, 0.15, 0.05]])))
    assert calls[:2] == [(3, slot5), (4, slot5)]
    assert order == [3, 4, 5, 1]
    assert link.kinds() == ["demand"] and link.submitted[0][1] == 1  # expert 1 loaded; none for the substituted
    st = cache.stats[0]["decode"]
    assert (st.misses, st.substituted, st.dropped, st.hits) == (3, 2, 0, 1)


def test_never_firing_thresholds_keep_tokens_and_always_committing_moves_nothing(tiny_models):
    model = tiny_models("olmoe", seed=4)
    ids = prompt_ids(model.config.vocab_size, n=10)
    ref, _ = greedy(model, ids, 8)
    for kind in ("drop", "commit"):  # threshold 0: no share is below it, no router mass is below it
        cfg = OffloadConfig.preset("fate", link="instant", slots=4, lossy=kind, lossy_threshold=0.0)
        with offload(model, cfg) as rt:
            out, _ = greedy(model, ids, 8)
            d = rt.stats.summary()["decode"]
        assert torch.equal(out, ref), kind
        assert d["dropped"] == d["substituted"] == 0
    # always uncertain, no predictor: a committed decode step queues no transfer at all
    cfg = OffloadConfig.preset("fate", link="instant", slots=4, lossy="commit", lossy_threshold=1.0, predictor=None)
    with offload(model, cfg) as rt:
        greedy(model, ids, 8)
        d = rt.stats.summary()["decode"]
    assert d["bytes_moved"] == 0 and d["dropped"] == d["misses"] > 0


def test_dropping_every_miss_renormalises_over_the_kept_experts(tiny_models):
    """A decode layer that keeps experts K' of the top-k returns sum_{K'} w y * (sum_k w / sum_{K'} w): checked
    against the plain experts module on the same input with the dropped weights zeroed and rescaled."""
    from fate_lab.model.adapters import adapt

    model = tiny_models("olmoe", seed=5)
    a = adapt(model)
    experts = a.experts_module(0)
    gate_up, down = experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone()
    cfg = OffloadConfig.preset("fate", link="instant", slots=2, lossy="drop", lossy_threshold=1.0, predictor=None)
    x = torch.randn(1, a.hidden_size, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([[0, 1, 2, 3][: a.top_k]])
    w = torch.linspace(0.4, 0.1, a.top_k).unsqueeze(0)
    with offload(model, cfg) as rt:
        rt.core.begin_forward("decode")
        rt.preload(0, [0])  # expert 0 resident, the rest miss and are dropped
        y = rt.layer_forward(0, x, idx, w)
    h = experts._apply_gate(torch.nn.functional.linear(x, gate_up[0]))
    expected = torch.nn.functional.linear(h, down[0]) * w[0, 0] * (w.sum() / w[0, 0])
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)


def test_standin_rule_by_hand():
    from fate_lab.policy.lossy import LOWP

    p = MissPolicy("standin", 0.0, window=2)
    share = {}
    assert p.plan(0, [3, 4], share, set(), None) == {3: LOWP, 4: LOWP}  # call 1: first misses stand in
    assert p.plan(0, [3], share, set(), None) == {}  # call 2: 3 recurs within 2 calls: load it
    assert p.plan(1, [3], share, set(), None) == {3: LOWP}  # another layer keeps its own memory
    assert p.plan(0, [5], share, set(), None) == {5: LOWP}  # call 3
    assert p.plan(0, [], share, set(), None) == {}  # call 4
    assert p.plan(0, [4], share, set(), None) == {4: LOWP}  # call 5: 4's low-precision use was at call 1: too long ago
    with pytest.raises(ValueError, match="window"):
        MissPolicy("standin", 0.0, window=-1)


def test_standin_runtime_computes_misses_from_resident_int2_copies(tiny_models):
    """All misses stand in (window 0: nothing ever counts as recurring) and no predictor: decode moves no byte,
    every miss computes from the INT2 copy, and the output stays close to the plain model's."""
    from fate_lab.core.sizing import standin_pool_bytes

    with pytest.raises(ValueError, match="group size 32"):  # mixtral's tiny expert width 40 takes no INT2 g32
        offload(tiny_models("mixtral"), OffloadConfig.preset("standin", link="instant", slots=2))
    model = tiny_models("deepseek_v2", seed=7)
    ids = prompt_ids(model.config.vocab_size, n=10)
    ref, ref_scores = greedy(model, ids, 8)
    cfg = OffloadConfig.preset("standin", link="instant", slots=2, standin_window=0, predictor=None)
    with offload(model, cfg) as rt:
        out, scores = greedy(model, ids, 8)
        d = rt.stats.summary()["decode"]
        a = rt.adapter
        pool = standin_pool_bytes(a.num_moe_layers, a.num_experts, (2 * a.expert_intermediate_size, a.hidden_size),
                                  (a.hidden_size, a.expert_intermediate_size))
        assert rt.describe()["standin_bytes"] == pool > 0
        assert rt.plan.budget_bytes >= pool  # the planner counts the pool
    assert d["bytes_moved"] == 0 and d["substituted"] == d["misses"] > 0
    assert not torch.equal(scores, ref_scores)  # INT2 weights really computed
    torch.testing.assert_close(scores.softmax(-1), ref_scores.softmax(-1), atol=0.05, rtol=0)
