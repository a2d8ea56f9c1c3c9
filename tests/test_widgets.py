"""The functions behind the notebook widgets, on a hand-built trace (no browser)."""
import pytest
import torch

from fate_lab import widgets
from fate_lab.trace import DECODE, PREFILL, Trace


@pytest.fixture
def hand_trace():
    # E=4 experts, H=4, L=2 layers, k=1. Layer 1's router is 10 x identity, so the cross-layer
    # prediction for layer 1 is the argmax of the token's layer-0 gate input.
    gate = torch.zeros(4, 2, 4)
    for t, e in enumerate([0, 1, 2, 3]):
        gate[t, 0, e] = 1.0  # token t's layer-0 gate input points at expert t
    W = torch.stack([torch.eye(4), 10 * torch.eye(4)])  # (L, E, H)
    experts = torch.tensor([[[0], [0]], [[1], [2]], [[2], [2]], [[3], [3]]])  # token 1 is mispredicted
    return Trace(experts=experts, token_ids=torch.arange(4), phase=torch.tensor([PREFILL, DECODE, DECODE, DECODE]),
                 prompt_id=torch.zeros(4, dtype=torch.long), position=torch.arange(4), gate_inputs=gate,
                 router_weights=W, meta={"num_experts": 4, "scoring": "softmax"})


def test_prefetch_table_topk_recall_by_hand(hand_trace):
    df = widgets.prefetch_table(hand_trace, "top-k", phase="decode")
    # decode tokens 1, 2, 3 predict experts 1, 2, 3 for layer 1; truth 2, 2, 3 -> 2 of 3 right
    assert df["layer"].tolist() == [1]
    assert df["recall"].iloc[0] == pytest.approx(2 / 3)
    assert df["precision"].iloc[0] == pytest.approx(2 / 3)
    assert df["mean_set_size"].iloc[0] == pytest.approx(1.0)


def test_prefetch_table_budget_of_all_experts_has_full_recall(hand_trace):
    df = widgets.prefetch_table(hand_trace, "count budget", 4, phase="decode")
    assert df["recall"].iloc[0] == 1.0 and df["precision"].iloc[0] == pytest.approx(1 / 4)


def test_unknown_choices_are_refused(hand_trace):
    with pytest.raises(ValueError, match="unknown rule"):
        widgets.prefetch_table(hand_trace, "magic")
    with pytest.raises(ValueError, match="calibration trace"):
        widgets.cache_table(hand_trace, 0, 2, "miss_curve")


def test_cache_table_one_slot_per_layer_by_hand(hand_trace):
    # 1 slot per layer, LRU, no prefetch. Layer 0 sees 0,1,2,3: all misses. Layer 1 sees
    # 0,2,2,3: misses, then a hit on the repeated 2, then a miss -> decode hits: layer 0 none,
    # layer 1 one of three.
    df = widgets.cache_table(hand_trace, 0, 2, "uniform", "lru", "none (cache only)")
    assert df["slots"].tolist() == [1, 1]
    assert df["hits"].tolist() == [0, 1]
    assert df.attrs["overall"]["hit_rate_decode"] == pytest.approx(1 / 6)


def test_cache_table_with_oracle_prefetch_hits_every_layer1_use(hand_trace):
    df = widgets.cache_table(hand_trace, 0, 2, "uniform", "lru", "oracle")
    assert df["hits"].tolist() == [0, 4]  # layer 0 cannot be prefetched; layer 1 always is


def test_cache_grid_shape_and_monotone_in_budget(hand_trace):
    grid = widgets.cache_grid(hand_trace, [0, 1], [2, 4, 8], "lru", "none (cache only)", phase="all")
    assert grid.shape == (2, 3)
    assert (grid.diff(axis=1).iloc[:, 1:] >= 0).all().all()


def test_explorers_build_without_a_browser(hand_trace):
    box = widgets.prefetch_explorer(hand_trace)
    assert len(box.children) == 2
    box = widgets.cache_explorer(hand_trace)
    assert len(box.children) == 3
