"""Policies from the caching field and SpecMD's least-stale: hand-derived victims, the protect contract."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_policies import LIRS, S3FIFO, SIEVE, LeastStale, LeCaR, splitmix64

from fate_lab.policy.registry import POLICIES, policy_from_name

FIELD = ["s3fifo", "sieve", "lirs", "lecar", "least_stale"]


def test_registered_by_name():
    for name in FIELD:
        assert name in POLICIES and policy_from_name(name, 3).name == name


def test_s3fifo_by_hand():
    c = S3FIFO(4, small_ratio=0.25)  # small 1 slot, main 3, ghost 3; promote after 2 hits
    assert (c.small_cap, c.main_cap, c.ghost_cap) == (1, 3, 3)
    for e in (1, 2, 3, 4):  # before the first eviction a full small queue sends new ids to main
        assert c.admit(e) is None
    assert (list(c.small), list(c.main)) == ([1], [2, 3, 4])
    c.access(1), c.access(1), c.access(2)
    # small's 1 was hit twice: it moves to main; main's 2 was hit once: reinserted; 3 goes
    assert c.admit(5) == 3
    assert (list(c.small), list(c.main)) == ([5], [4, 1, 2])
    assert c.admit(6) == 5  # 5 never hit: out of small into the ghost queue
    assert list(c.ghost) == [5]
    assert c.admit(5) == 6  # a ghost hit: 5 enters main, and small's 6 makes room
    assert (list(c.small), list(c.main), list(c.ghost)) == ([], [4, 1, 2, 5], [6])
    assert c.admit(7) == 4  # main over its share: its oldest unhit id goes (no ghost for main)
    assert c.admit(8, protect=frozenset({7})) == 1  # small's 7 is protected: main's oldest goes
    assert c.admit(9, protect=frozenset({2, 5, 7, 8})) == 9 and 9 not in c  # all protected: not cached


def test_sieve_by_hand():
    c = SIEVE(3)
    for e in (1, 2, 3):
        c.admit(e)
    c.access(1)
    assert c.admit(4) == 2  # the hand clears 1's bit and evicts 2; it rests on 3
    c.access(4)
    assert c.admit(5) == 3 and c.resident() == [1, 4, 5]
    assert c.admit(6) == 5  # 4's bit cleared, 5 goes; 5 was the newest: the hand restarts at the oldest
    c.access(6)
    assert c.admit(7) == 1 and c.hand == 4  # 1 lost its bit on the first sweep
    c.access(4)
    assert c.admit(8, protect=frozenset({6})) == 7  # 4's bit cleared; the hand passes 6 by, its bit stays set
    assert c.visited[6] and c.hand is None
    assert c.admit(9) == 4
    assert c.admit(10, protect=frozenset({6, 8, 9})) == 10


def test_lirs_by_hand():
    c = LIRS(3)  # 2 LIR slots, 1 resident HIR slot
    assert c.admit(1) is None and c.admit(2) is None  # the first ids become LIR
    assert c.admit(3) is None and list(c.queue) == [3]
    c.access(1)  # S = [2, 3, 1]
    assert c.admit(4) == 3  # Q's front goes; 3 stays in S, non-resident
    assert list(c.stack) == [2, 3, 1, 4] and list(c.queue) == [4]
    # 3 comes back while in S (a short reuse distance): LIR now; the bottom LIR 2 becomes HIR
    assert c.admit(3) == 4
    assert (list(c.stack), list(c.queue), c.lir) == ([1, 4, 3], [2], {1, 3})
    c.access(2)  # resident HIR not in S: stays HIR, pushed on S
    assert c.admit(5) == 2
    assert c.admit(4) == 5  # 4 is still in S: LIR; bottom LIR 1 is demoted
    assert (list(c.stack), list(c.queue), c.lir) == ([3, 2, 5, 4], [1], {3, 4})
    # Q's only id is protected: the LIR id nearest the bottom goes, and S is pruned down to an LIR id
    assert c.admit(6, protect=frozenset({1})) == 3
    assert (list(c.stack), list(c.queue), c.lir) == ([4, 6], [1, 6], {4})
    assert c.admit(7, protect=frozenset({1, 4, 6})) == 7


def test_splitmix64_reference_stream():
    state, outs = 0, []
    for _ in range(3):
        state, u = splitmix64(state)
        outs.append(u)
    # SplitMix64 from state 0 gives 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F
    assert outs == [(x >> 11) / 2 ** 53 for x in (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F)]


def test_lecar_by_hand():
    c = LeCaR(2, discount=1.0, seed=0)  # draws 0.883, 0.432, ...; no discount: every regret weighs e^0.45
    c.admit(1), c.access(1), c.access(1), c.admit(2)
    assert c.admit(3) == 2  # LRU says 1, LFU says 2; draw 0.883 >= w_lru 0.5: LFU's victim
    assert c.histories() == ([], [2])
    # 2 returns: LFU's mistake, LRU's weight grows to 1.5683 / 2.5683; LRU says 1, LFU says 3; draw 0.432 < 0.611
    assert c.admit(2) == 1
    assert c.w_lru == pytest.approx(math.exp(0.45) / (math.exp(0.45) + 1))
    assert c.admit(1) == 3  # 1 returns (LRU's mistake: weights even again); both experts say 3: no draw
    assert c.w_lru == pytest.approx(0.5)
    assert c.admit(4, protect=frozenset({2})) == 1
    assert c.admit(5, protect=frozenset({2, 4})) == 5


def test_least_stale_by_hand():
    c = LeastStale(2)
    c.admit(1), c.admit(2), c.access(2), c.access(1), c.access(2)  # references 1..5
    # intervals: 1 was reused after 3 references; 2 after 1, then 2 (0.75 * 1 + 0.25 * 2 = 1.25)
    assert c.staleness(1) == (6 - 4) / 3 and c.staleness(2) == (6 - 5) / 1.25
    assert c.admit(3) == 2  # 2 is overdue by more of its own intervals; LRU would evict 1
    assert c.admit(4, protect=frozenset({3})) == 1
    assert c.resident() == [3, 4]  # never reused: interval 1, so the older one is staler
    assert c.admit(5) == 3
    assert c.admit(6, protect=frozenset({4, 5})) == 6


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="small_ratio"):
        S3FIFO(4, small_ratio=1.0)
    with pytest.raises(ValueError, match="move_threshold"):
        S3FIFO(4, move_threshold=0)
    with pytest.raises(ValueError, match="stack_ratio"):
        LIRS(4, stack_ratio=0.5)
    with pytest.raises(ValueError, match="learning_rate"):
        LeCaR(4, learning_rate=-1)
    with pytest.raises(ValueError, match="alpha"):
        LeastStale(4, alpha=0.0)
    with pytest.raises(ValueError, match="capacity"):
        SIEVE(-1)


ops = st.lists(st.tuples(st.integers(0, 9), st.sets(st.integers(0, 9), max_size=3)), max_size=80)


@settings(max_examples=120, deadline=None)
@given(cap=st.integers(0, 6), seq=ops, name=st.sampled_from(FIELD))
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
        assert len(after) <= cap and len(p.resident()) == len(after)
        if v == e:
            assert after == before
        else:
            assert v is None and len(before) < cap or v in before and v not in prot
            assert after == (before - {v}) | {e}


@pytest.mark.parametrize("name", FIELD)
def test_simulator_and_replay_agree_with_the_field_policies(name):
    """The one cache has them: the timed simulator on an instant link and the replay give the same decode counts."""
    import torch

    from fate_lab.core.config import OffloadConfig
    from fate_lab.core.shape import ModelShape
    from fate_lab.hardware.profiles import COMPUTE_PROFILES
    from fate_lab.hardware.setups import Hardware
    from fate_lab.model.trace import from_routing_array
    from fate_lab.sim.replay import replay
    from fate_lab.sim.simulate import simulate

    g = torch.Generator().manual_seed(4)
    N, L, k, E = 300, 4, 2, 8
    pop = torch.distributions.Dirichlet(torch.full((E,), 0.3)).sample((L,))
    ex = torch.stack([torch.multinomial(pop[l].expand(N, E), k, generator=g) for l in range(L)], 1)
    tr = from_routing_array(ex, num_experts=E)
    cfg = OffloadConfig(name, slots=10, predictor=None, allocation="uniform", replacement=name)
    sim = simulate(tr, cfg, Hardware(COMPUTE_PROFILES["qwen15_moe_rtx3090"], None), ModelShape(L, L, E, k, 8, 8,
                                                                                              torch.float32, 0, 0))
    rep = replay(tr, slots_per_layer=sim.slots_per_layer, policy=name)
    assert [s["decode"].hits for s in sim.layers] == [p["hits"] for p in rep.per_layer]
    assert [s["decode"].misses for s in sim.layers] == [p["demand_loads"] for p in rep.per_layer]
