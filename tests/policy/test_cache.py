"""The one expert cache, driven directly by a scripted link: hand examples with exact expected states.

Slot layout of ``ExpertCache([c0, c1], top_k=K, prefetch_buffers=B)``:
[layer 0's c0 cache slots | layer 1's c1 | K demand slots | pool A (even layers) B slots | pool B (odd) B slots].
Every test ends with `check_slots()`: no slot lost, none owned twice.
"""
import pytest
from helpers import ScriptedMover
from reference_policies import LRU

from fate_lab.policy.cache import ExpertCache


def _cache(link, slots=(2,), top_k=2, buffers=1, **kw) -> ExpertCache:
    c = ExpertCache(list(slots), lambda m, cap: LRU(cap), top_k, buffers, link, **kw)
    c.phase = "decode"
    return c


def _call(cache: ExpertCache, m: int, needed: list[int]) -> list[tuple[int, int]]:
    """One experts call of layer m: (expert, slot) in compute order."""
    out = []
    for e in cache.begin(m, needed):
        out.append((e, cache.acquire(m, e)))
        cache.done(m, e)
    cache.end(m)
    return out


def test_misses_load_into_cache_slots_and_lru_evicts_the_oldest_unprotected():
    link = ScriptedMover()
    c = _cache(link)  # cache slots [0, 1], demand [2, 3], pools [4], [5]
    assert _call(c, 0, [1, 2]) == [(1, 0), (2, 1)]
    assert link.submitted == [(0, 1, 0, True, "miss"), (0, 2, 1, True, "miss")]
    assert link.waits == [(0, 1), (0, 2)]  # both were still on the link when they were needed
    # 2 is a hit (and touched); 3 misses: LRU evicts 1 (older), not 2 (protected, and newer)
    assert _call(c, 0, [2, 3]) == [(2, 1), (3, 0)]
    assert link.submitted[-1] == (0, 3, 0, True, "miss")
    layer = c.layers[0]
    assert layer.where == {2: 1, 3: 0} and layer.valid == {2, 3}
    st = c.stats[0]["decode"]
    assert (st.calls, st.uses, st.hits, st.misses, st.late) == (2, 4, 1, 3, 0)
    c.check_slots()


def test_a_used_prefetch_is_promoted_by_swapping_slot_owners():
    """admit_on_use: the prefetched expert waits in pool B's slot 4; when used it joins layer 1's cache by taking
    slot 4 over, and layer 1's old cache slot 1 goes to pool B. No byte moves for the promotion."""
    link = ScriptedMover()
    c = _cache(link, slots=(1, 1), top_k=1, buffers=1, admit_on_use=True)  # [0 | 1 | demand 2 | A 3 | B 4]
    c.begin(0, [5])
    assert c.prefetch(1, [7]) == 1
    assert link.submitted == [(0, 5, 0, True, "miss"), (1, 7, 4, False, "prefetch")]
    c.acquire(0, 5)
    c.done(0, 5)
    c.end(0)
    link.land(1)  # the prefetch arrives before layer 1 runs
    assert _call(c, 1, [7]) == [(7, 4)]
    layer = c.layers[1]
    assert layer.cache_slots == [4] and layer.where == {7: 4} and layer.staged == {}
    assert c.prefetch_pools[1].free == [1]
    st = c.stats[1]["decode"]
    assert (st.hits, st.late, st.prefetch_issued, st.prefetch_useful, st.prefetch_wasted) == (1, 0, 1, 1, 0)
    assert (st.predictions, st.predicted, st.predicted_used, st.true_used) == (1, 1, 1, 1)
    c.check_slots()


def test_a_late_prefetch_becomes_urgent_and_counts_as_late():
    link = ScriptedMover()
    c = _cache(link, slots=(1, 1), top_k=1, buffers=1, admit_on_use=True)
    c.prefetch(1, [7])  # still queued when layer 1 needs it
    assert _call(c, 1, [7]) == [(7, 4)]
    assert link.cancelled == [(1, 7, 4, False, "prefetch")]
    assert link.submitted[-1] == (1, 7, 4, True, "prefetch")  # re-queued ahead of the prefetches
    st = c.stats[1]["decode"]
    assert (st.late, st.hits, st.misses) == (1, 0, 0)
    c.check_slots()


def test_a_stale_prefetch_already_on_the_link_keeps_its_slot_until_it_lands():
    link = ScriptedMover()
    c = _cache(link, slots=(1, 1), top_k=1, buffers=1, admit_on_use=True)
    c.prefetch(1, [7])
    link.start(0)  # the link began moving it: it can no longer be cancelled
    assert _call(c, 1, [8]) == [(8, 1)]  # 7 was not needed; 8 misses into layer 1's cache slot
    assert c.zombies == [(4, 0)] and c.prefetch_pools[1].free == []
    assert c.stats[1]["decode"].prefetch_wasted == 1
    c.check_slots()
    link.land(0)
    _call(c, 1, [8])  # the next call reaps the landed transfer: slot 4 is back in pool B
    assert c.zombies == [] and c.prefetch_pools[1].free == [4]
    c.check_slots()


def test_the_link_budget_caps_how_many_prefetches_start():
    link = ScriptedMover(capacity=1)
    c = _cache(link, slots=(1, 1), top_k=1, buffers=2, admit_on_use=True, link_budget=True)
    assert c.prefetch(1, [7, 8]) == 1  # the most probable first; the link can start one in time
    assert [s[1] for s in link.submitted] == [7]
    assert c.layers[1].prediction == [7, 8]  # the prediction itself is kept whole (recall counts it)
    c.check_slots()


def test_a_failed_transfer_is_counted_and_reloaded_synchronously():
    link = ScriptedMover()
    link.fail.add(0)
    c = _cache(link)
    assert _call(c, 0, [3]) == [(3, 0)]
    assert link.reloads == [(0, 3, 0, "miss")] and c.stats[0]["decode"].failures == 1
    c.check_slots()


def test_load_on_demand_forgets_what_it_loaded():
    link = ScriptedMover(instant=True)
    c = _cache(link, cache=False)
    _call(c, 0, [1])
    _call(c, 0, [1])
    assert [s[3] for s in link.submitted] == [True, True]  # loaded twice: nothing stays
    assert c.stats[0]["decode"].hits == 0
    c.check_slots()


def test_check_slots_names_a_lost_slot():
    c = _cache(ScriptedMover())
    c.pools.pn[0] -= 1  # the demand pool forgets its last free slot
    with pytest.raises(RuntimeError, match="lost"):
        c.check_slots()
