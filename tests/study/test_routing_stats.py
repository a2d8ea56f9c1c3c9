"""Routing statistics on hand-built routings with exact expected numbers."""
import pytest
import torch

from fate_lab.study.routing_stats import reuse_distance, transition_entropy


def test_a_deterministic_transition_carries_all_of_the_next_layers_entropy():
    ex = torch.tensor([[[0], [2]], [[0], [2]], [[1], [3]], [[1], [3]]])  # (N=4, L=2, k=1): 0 -> 2, 1 -> 3
    row = transition_entropy(ex, 4).iloc[0]
    assert (row["H(next) bits"], row["H(next | current) bits"], row["mutual information bits"]) == (1.0, 0.0, 1.0)
    assert row["share of H(next) explained"] == 1.0 and row["uniform bits"] == 2.0
    indep = torch.tensor([[[0], [2]], [[0], [3]], [[1], [2]], [[1], [3]]])  # the next expert ignores the current
    assert transition_entropy(indep, 4).iloc[0]["mutual information bits"] == pytest.approx(0.0)


def test_reuse_distance_by_hand():
    ex = torch.tensor([[[0]], [[1]], [[0]], [[0]]])  # one layer, one prompt: 0 1 0 0
    row = reuse_distance(ex, 2).iloc[0]  # 0 reused 2 later, then 1 later; 1 and the last 0 never again
    assert (row["uses"], row["reused next token"], row["reused within 4"], row["never again"]) == (4, 0.25, 0.5, 0.5)
    assert row["median distance (reused)"] == 1.0
    two = reuse_distance(ex, 2, prompt_id=torch.tensor([0, 0, 1, 1])).iloc[0]  # a new prompt starts at token 2
    assert (two["reused next token"], two["never again"]) == (0.25, 0.75)
    dec = reuse_distance(ex, 2, phase=torch.tensor([0, 1, 1, 1])).iloc[0]  # token 0 is prefill: left out
    assert (dec["uses"], dec["reused next token"]) == (3, pytest.approx(1 / 3))
