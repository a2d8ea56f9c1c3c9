"""Slot allocation and the memory planner: exact outputs on small cases."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fate_lab.policy.allocation import (
    MissCurveAllocation,
    ShallowFavoringAllocation,
    UniformAllocation,
    allocation_from_name,
    lru_miss_curves,
)
from fate_lab.policy.planner import plan_from_slots, plan_memory


def test_uniform():
    u = UniformAllocation()
    assert u.allocate(10, 4, 8) == [3, 3, 2, 2]
    assert u.allocate(3, 4, 8) == [1, 1, 1, 0]
    assert u.allocate(32, 4, 8) == [8, 8, 8, 8]
    assert u.allocate(100, 4, 8) == [8, 8, 8, 8]
    assert u.allocate(0, 4, 8) == [0, 0, 0, 0]


def test_shallow_favoring():
    a = ShallowFavoringAllocation(2)
    assert a.allocate(20, 6, 8) == [8, 8, 1, 1, 1, 1]
    assert a.allocate(21, 6, 8) == [8, 8, 2, 1, 1, 1]  # remainder to the shallowest deep layer
    assert a.allocate(10, 6, 8) == [8, 2, 0, 0, 0, 0]  # shallow layers first, even if deep get none
    assert a.allocate(100, 6, 8) == [8] * 6
    assert ShallowFavoringAllocation(0).allocate(10, 4, 8) == UniformAllocation().allocate(10, 4, 8)
    assert ShallowFavoringAllocation(10).allocate(20, 4, 8) == [8, 8, 4, 0]
    assert allocation_from_name("shallow", shallow_layers=2).allocate(20, 6, 8) == [8, 8, 1, 1, 1, 1]


# layer 0 gains 1 miss per slot; layer 1 gains nothing until its 3-expert working set fits;
# layer 2 gains 5 with its first slot, then 1.
CURVES = [[10, 9, 8, 7, 6], [10, 10, 10, 0, 0], [10, 5, 4, 4, 4]]


@pytest.mark.parametrize(
    "total, expected",
    [
        (3, [0, 3, 0]),  # 10 saved; a greedy allocator would take 5 + 1 + 1
        (4, [0, 3, 1]),  # 15 saved
        (2, [1, 0, 1]),  # 6 saved either as [0,0,2] or [1,0,1]: fewer slots to the deeper layer
        (9, [4, 3, 2]),  # all 20 reducible misses
        (11, [4, 4, 3]),  # [4,3,2] + 2 spare slots handed out shallow-first
        (12, [4, 4, 4]),
        (50, [4, 4, 4]),
    ],
)
def test_miss_curve_allocation(total, expected):
    assert MissCurveAllocation(CURVES).allocate(total, 3, 4) == expected


def test_miss_curve_allocation_checks_shape():
    with pytest.raises(ValueError, match="layers"):
        MissCurveAllocation(CURVES).allocate(4, 2, 4)


def test_lru_miss_curves_by_hand():
    # one layer, k = 1: 1 2 1 3 1. c=1: all 5 miss; c=2: 1m 2m 1h 3m 1h -> 3 (stack depths 1, 1)
    ex = torch.tensor([1, 2, 1, 3, 1]).reshape(5, 1, 1)
    assert lru_miss_curves(ex, 4) == [[5, 5, 3, 3, 3]]


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(0, 60),
    L=st.integers(1, 6),
    E=st.integers(1, 8),
    shallow=st.integers(0, 7),
)
def test_allocation_contract(total, L, E, shallow):
    for alloc in (UniformAllocation(), ShallowFavoringAllocation(shallow)):
        out = alloc.allocate(total, L, E)
        assert len(out) == L and all(0 <= s <= E for s in out) and sum(out) <= total
        assert sum(out) == min(total, L * E)  # neither allocator wastes a slot
        if total >= L * E:
            assert out == [E] * L


def test_miss_curve_contract():
    g = torch.Generator().manual_seed(0)
    ex = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(300)]).reshape(100, 3, 2)
    alloc = MissCurveAllocation.from_trace(ex, 8)
    for total in range(0, 30):
        out = alloc.allocate(total, 3, 8)
        assert sum(out) == min(total, 24) and all(0 <= s <= 8 for s in out)


def test_plan_memory():
    # kv = 2 * 50 = 100, buffers = (2 + 3) * 30 = 150, minimum = 100 + 100 + 150 = 350
    p = plan_memory(1000, 100, 2, 50, 30, 4, 2, 3)
    assert (p.kv_bytes, p.buffer_bytes, p.min_budget_bytes, p.cache_total) == (100, 150, 350, 21)  # 650 // 30
    assert plan_memory(1000, 100, 2, 50, 30, 4, 2, 3, num_experts=4).cache_total == 16
    assert plan_memory(350, 100, 2, 50, 30, 4, 2, 3).cache_total == 0
    with pytest.raises(ValueError, match=r"350 bytes \(0\.0 MiB\)"):
        plan_memory(349, 100, 2, 50, 30, 4, 2, 3)


def test_plan_from_slots():
    p = plan_from_slots(5, 100, 2, 50, 30, 4, 2, 3)
    assert (p.budget_bytes, p.cache_total, p.cache_bytes) == (500, 5, 150)
