"""Prefetch by value: the planner's arithmetic and the value cache, on hand examples with exact expected states.

`plan_prefetches` numbers are worked out in the comments (seconds): gain = p x (miss - lateness), cost = the
part of a transfer still on the link when the next layer starts, x (1 - p) for a next-layer candidate.
ValueCache slot layout as in test_cache.py: [layer caches | top_k demand slots | pool A (even) | pool B (odd)].
"""
import pytest
from helpers import ScriptedMover
from reference_policies import LRU

from fate_lab.policy.cache import HOST
from fate_lab.policy.placement import HostPlacement
from fate_lab.policy.value import (
    Candidate,
    LinkView,
    Planned,
    RankOdds,
    UseRate,
    plan_prefetches,
    worth_admitting,
    would_evict,
)
from fate_lab.policy.value_cache import ValueCache


def test_plan_keeps_what_lands_in_time_and_drops_what_would_delay_the_next_layers_demand_loads():
    view = LinkView(layer_s=1.0, backlog_s=0.0, prefetch_s=0.4, miss_s=0.4)
    cands = [Candidate(1, 5, 1, 0.9), Candidate(1, 6, 1, 0.5), Candidate(1, 7, 1, 0.2), Candidate(2, 3, 2, 0.6)]
    # most probable first: 5 (0..0.4, gain .36), 3 two ahead (0.4..0.8, gain .6 x .4 = .24);
    # 6 would run 0.8..1.2: late 0.2 -> gain .5 x .2 = .1, on the link 0.2 past the layer -> cost .2 x .5 = .1: net 0;
    # 7: gain .2 x .2 = .04 < cost .2 x .8 = .16
    assert plan_prefetches(cands, view) == [Planned(1, 5, False, 0.0, 0.4, pytest.approx(0.36), 0.0),
                                            Planned(2, 3, False, 0.4, pytest.approx(0.8), pytest.approx(0.24), 0.0)]


def test_a_late_prefetch_travels_low_when_that_saves_more():
    a = [Candidate(1, 5, 1, 0.9)]
    # full: 0.7..1.1, late .1 -> gain .9 x .3 = .27, cost .1 x .1 = .01 (net .26); low: 0.7..0.9 -> gain .36, no cost
    view = LinkView(1.0, 0.7, 0.4, 0.4, low_s=0.2)
    assert plan_prefetches(a, view) == [Planned(1, 5, True, 0.7, pytest.approx(0.9), pytest.approx(0.36), 0.0)]
    full = plan_prefetches(a, LinkView(1.0, 0.7, 0.4, 0.4))  # no low precision on offer
    assert [(p.low, p.gain_s, p.cost_s) for p in full] == [(False, pytest.approx(0.27), pytest.approx(0.01))]


def test_a_two_ahead_prefetch_pays_the_whole_delay_it_imposes_weighted_by_the_demand_odds():
    d = [Candidate(2, 3, 2, 0.6)]  # 0.8..1.2, lands long before layer m+2 (2.0): gain .6 x .4 = .24
    assert plan_prefetches(d, LinkView(1.0, 0.8, 0.4, 0.4))[0].cost_s == pytest.approx(0.2)  # 0.2 past the layer
    assert plan_prefetches(d, LinkView(1.0, 0.8, 0.4, 0.4, demand=0.5))[0].cost_s == pytest.approx(0.1)
    assert plan_prefetches(d, LinkView(1.0, 1.2, 0.4, 0.4)) == [Planned(2, 3, False, 1.2, pytest.approx(1.6),
                                                                        pytest.approx(0.24), 0.0)]  # starts after


def test_link_view_refuses_what_is_not_a_time():
    with pytest.raises(ValueError, match="backlog_s=-1"):
        LinkView(1.0, -1, 0.4, 0.4)
    with pytest.raises(ValueError, match="low_s=inf"):
        LinkView(1.0, 0.0, 0.4, 0.4, low_s=float("inf"))


def test_rank_odds_and_use_rates_by_hand():
    odds = RankOdds(prior=0.5, weight=2.0)
    assert odds.p(1, 0) == 0.5
    for _ in range(3):
        odds.record(1, 0, True)
    assert odds.p(1, 0) == pytest.approx(4 / 5)
    odds.record(1, 0, False)
    assert odds.p(1, 0) == pytest.approx(4 / 6) and odds.p(2, 0) == 0.5
    r = UseRate(decay=0.5)
    r.call([1, 2])
    r.call([1])
    assert (r.rate(1), r.rate(2)) == (1.5, 0.5)
    r.call([])
    assert (r.rate(1), r.rate(2), r.rate(9)) == (0.75, 0.25, 0.0)
    assert worth_admitting(1.0, None) and worth_admitting(1.0, 0.5) and not worth_admitting(1.0, 1.0)
    assert would_evict([4, 2, 7], {4}) == 2 and would_evict([4], {4}) is None


def _vcache(link, slots, top_k=2, buffers=2, **kw) -> ValueCache:
    c = ValueCache(list(slots), lambda m, cap: LRU(cap), top_k, buffers, link, admit_on_use=True, **kw)
    c.phase = "decode"
    return c


def _call(cache, m, needed):
    out = []
    for e in cache.begin(m, needed):
        out.append((e, cache.acquire(m, e)))
        cache.done(m, e)
    cache.end(m)
    return out


def test_on_an_instant_link_every_candidate_is_queued_nearest_layer_first_and_its_outcome_is_learned():
    link = ScriptedMover(instant=True)
    c = _vcache(link, (2, 2, 2))  # layers [0,1] [2,3] [4,5] | demand [6,7] | pool A [8,9] | pool B [10,11]
    c.begin(0, [1, 2])
    assert c.prefetch_ahead(0, [(1, [3, 4, 5]), (2, [6])]) == 3  # pool B holds two: 5 finds no slot
    assert link.submitted[2:] == [(1, 3, 11, False, "prefetch"), (1, 4, 10, False, "prefetch"),
                                  (2, 6, 9, False, "prefetch")]
    assert c.layers[1].prediction == [3, 4, 5] and c.layers[2].prediction is None  # recall counts the next layer's
    for e in (1, 2):
        c.acquire(0, e)
        c.done(0, e)
    c.end(0)
    assert _call(c, 1, [3, 7]) == [(3, 11), (7, 2)]  # 3 was staged (a hit), 7 a miss into a cache slot
    assert (c.odds.p(1, 0), c.odds.p(1, 1), c.odds.p(1, 2)) == (pytest.approx(2 / 3), pytest.approx(1 / 3),
                                                                 pytest.approx(1 / 3))
    st = c.stats[1]["decode"]
    assert (st.hits, st.misses, st.prefetch_useful, st.prefetch_wasted, st.predicted_used) == (1, 1, 1, 1, 1)
    c.check_slots()


def test_value_planning_sends_a_late_prefetch_low_only_when_offered():
    for offered, reason in ((True, "prefetch_low"), (False, "prefetch")):
        link = ScriptedMover()
        link.timing = LinkView(1.0, 0.7, 0.4, 0.4, low_s=0.2)
        c = _vcache(link, (1, 1), top_k=1, buffers=1, low_offered=offered)
        assert c.prefetch_ahead(0, [(1, [3])]) == 1
        assert link.submitted == [(1, 3, 4, False, reason)]


def test_queued_prefetches_are_cancelled_and_replanned_each_layer_started_ones_run_on():
    link = ScriptedMover()
    link.timing = LinkView(1.0, 0.0, 0.4, 0.4)
    c = _vcache(link, (1, 1, 1), top_k=1, buffers=2)  # [0 | 1 | 2 | demand 3 | A 4,5 | B 6,7]
    assert c.prefetch_ahead(0, [(1, [3]), (2, [6])]) == 2  # h0: layer 1's 3, h1: layer 2's 6 (two ahead)
    link.land(0)
    assert _call(c, 1, [3]) == [(3, 7)]
    assert c.prefetch_ahead(1, [(2, [6, 8])]) == 2  # h1 was never started: cancelled, re-planned with 8
    assert link.cancelled == [(2, 6, 5, False, "prefetch")]
    assert link.submitted[2:] == [(2, 6, 5, False, "prefetch"), (2, 8, 4, False, "prefetch")]
    st = c.stats[2]["decode"]
    assert (st.prefetch_issued, st.prefetch_wasted) == (3, 1)
    link.start(3)  # 8 is on the link now: the next round leaves it alone, and 6 is no longer predicted
    assert c.prefetch_ahead(1, [(2, [8])]) == 0
    assert link.cancelled[1:] == [(2, 6, 5, False, "prefetch")] and len(link.submitted) == 4
    assert set(c.layers[2].inflight) == {8} and c.stats[2]["decode"].prefetch_wasted == 2
    c.check_slots()


def test_host_fill_loads_a_host_computed_miss_in_the_background_and_it_hits_next_time():
    link = ScriptedMover()
    link.timing = LinkView(1.0, 0.0, 0.4, 0.4)
    place = HostPlacement("cost", frozenset(), lambda n: 0.1, transfer_s=0.4)
    c = _vcache(link, (1,), top_k=1, buffers=0, placement=place, host_fill=True, value_prefetch=False)
    assert _call(c, 0, [5]) == [(5, HOST)]
    assert link.submitted == [(0, 5, 0, False, "fill")] and c.stats[0]["decode"].filled == 1
    link.land(0)
    assert _call(c, 0, [5]) == [(5, 0)] and c.stats[0]["decode"].hits == 1
    link.timing = LinkView(1.0, 0.7, 0.4, 0.4)  # the link is busy for 0.7 of the next layer: no room to fill
    assert _call(c, 0, [6]) == [(6, HOST)] and len(link.submitted) == 1
    c.check_slots()


def test_with_host_fill_a_needed_prefetch_not_started_yet_becomes_a_host_call():
    link = ScriptedMover()
    link.timing = LinkView(1.0, 0.0, 0.4, 0.4)
    place = HostPlacement("cost", frozenset(), lambda n: 0.1, transfer_s=0.4)
    c = _vcache(link, (1, 1), top_k=1, buffers=1, placement=place, host_fill=True)
    c.prefetch_ahead(0, [(1, [3])])  # queued, never started
    assert _call(c, 1, [3]) == [(3, HOST)] and link.cancelled == [(1, 3, 4, False, "prefetch")]
    assert link.waits == []  # nothing waited for the link
    c.check_slots()


def test_a_used_prefetch_evicts_only_an_expert_used_less():
    link = ScriptedMover(instant=True)
    c = _vcache(link, (1, 1), top_k=1, buffers=1)  # [0 | 1 | demand 2 | A 3 | B 4]
    for _ in range(3):
        _call(c, 1, [2])  # 2 cached in layer 1, used three calls running: rate 1 + .9 + .81
    c.prefetch_ahead(0, [(1, [3])])
    assert _call(c, 1, [3]) == [(3, 4)]  # used from staging; rate 1 < 2's 2.44: not promoted
    assert c.layers[1].where == {2: 1} and _call(c, 1, [2]) == [(2, 1)]
    c.check_slots()


def test_a_fill_not_started_is_left_alone_by_replanning_and_refilled_after_the_host_took_it():
    link = ScriptedMover()
    link.timing = LinkView(1.0, 0.0, 0.4, 0.4)
    place = HostPlacement("cost", frozenset(), lambda n: 0.1, transfer_s=0.4)
    c = _vcache(link, (1, 1), top_k=1, buffers=1, placement=place, host_fill=True)  # [0 | 1 | d 2 | A 3 | B 4]
    assert _call(c, 1, [5]) == [(5, HOST)] and link.submitted == [(1, 5, 1, False, "fill")]
    c.prefetch_ahead(0, [(1, [6])])  # re-planning layer 1 cancels prefetches, never the fill
    assert link.cancelled == [] and link.submitted[-1] == (1, 6, 4, False, "prefetch")
    assert _call(c, 1, [5]) == [(5, HOST)]  # the fill never started: cancelled, the host takes 5 ...
    assert link.cancelled[0] == (1, 5, 1, False, "fill") and link.submitted[-1] == (1, 5, 1, False, "fill")
    assert c.layers[1].where == {5: 1}  # ... and it is filled again into the slot it kept
    c.check_slots()
