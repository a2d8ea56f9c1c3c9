"""Replacement policies: step-by-step sequences with hand-derived states, plus invariants."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_policies import ARC, LFU, LRFU, LRU, Belady

from fate_lab.policy.registry import policy_from_name


def test_lru_steps_and_protect():
    c = LRU(2)
    assert c.admit(1) is None and c.admit(2) is None
    c.access(1)  # order (old -> new): 2, 1
    assert c.admit(3) == 2
    assert c.resident() == [1, 3]
    assert c.admit(4, protect=frozenset({1})) == 3  # 1 is older but protected
    assert c.resident() == [1, 4]
    assert c.admit(5, protect=frozenset({1, 4})) == 5  # everything protected: not cached
    assert c.resident() == [1, 4] and 5 not in c


def test_capacity_zero_means_not_cached():
    for name in ("lru", "lfu", "arc", "lrfu"):
        p = policy_from_name(name, 0)
        assert p.admit(7) == 7 and 7 not in p and p.resident() == []
    assert Belady(0, [[7]]).admit(7) == 7


def test_lfu_keep_history_changes_the_victim():
    def run(keep):
        c = LFU(2, keep_history=keep)
        c.admit(1)  # count 1
        c.admit(2)  # count 1
        c.access(1)  # 1: count 2
        assert c.admit(3) == 2  # 2 has the lowest count
        c.access(3)  # 3: count 2, more recent than 1
        assert c.admit(2) == 1  # tie on count 2 (history) or 1 vs 2: 1 is least recent among the lowest
        return c.admit(4)

    # with history, 2 came back with count 2 (1 old + 1 now): tie with 3, 3 is older -> 3 goes
    assert run(True) == 3
    # without history, 2 restarted at count 1 -> 2 goes
    assert run(False) == 2


def test_arc_steps():
    """Megiddo & Modha (2003), Fig. 4, by hand: a ghost hit adapts p first, then REPLACE(x, p) runs."""
    a = ARC(2)
    assert a.admit(1) is None and a.admit(2) is None
    a.access(1)  # T1=[2], T2=[1]
    assert (list(a.t1), list(a.t2)) == ([2], [1])
    assert a.admit(3) == 2  # case IV, |T1|=1 > p=0: T1's LRU goes to B1
    assert (list(a.t1), list(a.t2), list(a.b1), a.p) == ([3], [1], [2], 0)
    assert a.admit(2) == 1  # ghost hit in B1: p -> 1 first; |T1| = 1 is not > p, so T2's LRU (1) goes to B2
    assert (list(a.t1), list(a.t2), list(a.b1), list(a.b2), a.p) == ([3], [2], [], [1], 1)
    assert a.admit(4) == 2  # case IV: |T1| = p, x not in B2: T2's LRU goes to B2
    assert (list(a.t1), list(a.t2), list(a.b1), list(a.b2)) == ([3, 4], [], [], [1, 2])
    assert a.admit(1) == 3  # ghost hit in B2: p -> 0 first; |T1| = 2 > 0: T1's LRU goes to B1
    assert (list(a.t1), list(a.t2), list(a.b1), list(a.b2), a.p) == ([4], [1], [3], [2], 0)


def test_arc_capacity_one_drops_without_ghost():
    a = ARC(1)
    a.admit(1)
    assert a.admit(2) == 1  # |T1| = c: T1's LRU is dropped, no ghost kept
    assert list(a.b1) == [] and a.resident() == [2]


def test_arc_protect():
    a = ARC(2)
    a.admit(1)
    a.admit(2)
    assert a.admit(3, protect=frozenset({1})) == 2
    assert a.admit(4, protect=frozenset({1, 3})) == 4


ops = st.lists(st.tuples(st.integers(0, 7), st.sets(st.integers(0, 7), max_size=2)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(cap=st.integers(0, 4), seq=ops)
def test_arc_invariants(cap, seq):
    a = ARC(cap)
    for e, prot in seq:
        if e in a:
            a.access(e)
        else:
            v = a.admit(e, frozenset(prot) - {e})
            assert v is None or v == e or v not in prot
        assert len(a.t1) + len(a.t2) <= cap
        assert len(a.t1) + len(a.b1) <= cap
        assert len(a.t1) + len(a.t2) + len(a.b1) + len(a.b2) <= 2 * cap
        assert 0 <= a.p <= cap
        assert not (set(a.t1) | set(a.t2)) & (set(a.b1) | set(a.b2))


@settings(max_examples=100, deadline=None)
@given(cap=st.integers(0, 4), seq=ops, name=st.sampled_from(["lru", "lfu", "arc", "lrfu"]))
def test_capacity_and_protect_respected(cap, seq, name):
    p = policy_from_name(name, cap)
    for e, prot in seq:
        if e in p:
            p.access(e)
            continue
        prot = frozenset(prot) - {e}
        before = set(p.resident())
        v = p.admit(e, prot)
        after = set(p.resident())
        assert len(after) <= cap
        if v == e:
            assert after == before
        else:
            assert v is None or v in before and v not in prot
            assert after == (before - {v}) | {e}


def test_lrfu_extremes():
    # lam = 0 scores are plain counts (LFU)
    f = LRFU(2, lam=0.0)
    f.admit(1)
    f.access(1)
    f.admit(2)
    assert f.admit(3) == 2
    # large lam is recency (LRU)
    r = LRFU(2, lam=4.0)
    r.admit(1)
    r.access(1)
    r.access(1)
    r.admit(2)
    assert r.admit(3) == 1


def test_belady_evicts_furthest_next_use():
    b = Belady(2, [[1], [2], [3], [1], [2]])
    b.at(0)
    b.admit(1)
    b.at(1)
    b.admit(2)
    b.at(2)
    assert b.admit(3) == 2  # 1 is next used at t=3, 2 at t=4
    b.at(4)
    assert b.admit(2) == 1  # both never used again: the smaller id goes


def test_policy_from_name_errors():
    with pytest.raises(ValueError, match="unknown replacement policy"):
        policy_from_name("fifo", 2)
    with pytest.raises(ValueError, match="future"):
        policy_from_name("belady", 2)
    with pytest.raises(ValueError, match="capacity"):
        LRU(-1)


def test_router_ema_by_hand():
    from reference_policies import RouterEMA

    p = RouterEMA(2, decay=0.5)
    assert p.wants_scores
    p.observe([0.6, 0.3, 0.1])  # scores 0.3, 0.15, 0.05
    assert p.admit(0) is None and p.admit(2) is None
    p.observe([0.1, 0.1, 0.8])  # scores 0.2, 0.125, 0.425
    assert p.admit(1, protect=frozenset({1})) == 0  # lowest score 0.2 goes, though 2 is older
    assert sorted(p.resident()) == [1, 2]
    p.observe([0.0, 0.0, 0.0], n_tokens=2)  # decay 0.25: 0.05, 0.03125, 0.10625
    assert p.resident() == [1, 2]
    assert p.admit(0, protect=frozenset({1, 2})) == 0  # everything protected: not cached
    with pytest.raises(ValueError, match="decay"):
        RouterEMA(2, decay=1.0)


def test_router_ema_replay_needs_router_scores():
    from fate_lab.sim.replay import replay

    with pytest.raises(ValueError, match="router"):
        replay(torch.zeros(3, 1, 1, dtype=torch.long), slots_per_layer=1, policy="router_ema")
