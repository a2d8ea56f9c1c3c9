"""Gate-input similarity and routing flatness on hand-built tensors."""
import math

import pytest
import torch

from fate_lab.study.analysis import adjacent_cosine, adjacent_cosine_per_token, cosine_matrix, routing_flatness

# (N=2 tokens, L=3 layers, H=2)
GI = torch.tensor([
    [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]],
    [[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]],
])


def test_adjacent_cosine_by_hand():
    rows = adjacent_cosine(GI, phase=torch.tensor([0, 1]))
    s = 1 / math.sqrt(2)
    # layers 0-1: token 0 cos 1, token 1 cos 1/sqrt2; layers 1-2: 0 and (1,1).(0,2)/(sqrt2*2) = 1/sqrt2
    assert rows[0]["cosine"] == pytest.approx((1 + s) / 2)
    assert rows[1]["cosine"] == pytest.approx(s / 2)
    assert (rows[0]["cosine_prefill"], rows[0]["cosine_decode"]) == (pytest.approx(1.0), pytest.approx(s))
    assert (rows[1]["layer"], rows[1]["next_layer"]) == (1, 2)
    assert "cosine_prefill" not in adjacent_cosine(GI)[0]


def test_adjacent_cosine_per_token_by_hand():
    s = 1 / math.sqrt(2)
    # token 0: pairs (0,1) 1 and (1,2) 0; token 1: 1/sqrt2 and 1/sqrt2 (as in the hand example above)
    assert adjacent_cosine_per_token(GI).tolist() == pytest.approx([0.5, s])
    assert adjacent_cosine_per_token(GI, pairs=[1]).tolist() == pytest.approx([0.0, s])
    with pytest.raises(ValueError, match="pairs"):
        adjacent_cosine_per_token(GI, pairs=[2])


def test_cosine_matrix_by_hand():
    m = cosine_matrix(GI)
    s = 1 / math.sqrt(2)
    expected = torch.tensor([[1, (1 + s) / 2, 0], [(1 + s) / 2, 1, s / 2], [0, s / 2, 1]])
    assert torch.allclose(m, expected, atol=1e-6)


def test_routing_flatness_by_hand():
    E = 4
    logits = torch.zeros(4, 2, E)  # layer 0: uniform routing
    logits[:, 1, 0] = 100.0  # layer 1: always expert 0, with certainty
    experts = torch.tensor([[[0], [0]], [[0], [0]], [[1], [0]], [[2], [0]]])  # (N=4, L=2, k=1)
    rows = routing_flatness(logits, experts)
    flat, peaked = rows
    assert flat["entropy"] == pytest.approx(math.log(E)) and flat["normalized_entropy"] == pytest.approx(1.0)
    assert flat["top1_prob"] == pytest.approx(0.25) and flat["topk_mass"] == pytest.approx(0.25)
    # layer 0 load [2, 1, 1, 0]: max / mean = 2, population std sqrt(0.5) over mean 1
    assert flat["load_imbalance"] == pytest.approx(2.0) and flat["load_cv"] == pytest.approx(math.sqrt(0.5))
    assert peaked["entropy"] == pytest.approx(0.0, abs=1e-6) and peaked["top1_prob"] == pytest.approx(1.0)
    assert peaked["load_imbalance"] == pytest.approx(4.0)  # load [4, 0, 0, 0]
    assert routing_flatness(logits, top_k=2)[0]["topk_mass"] == pytest.approx(0.5)


def test_routing_flatness_phases():
    logits = torch.zeros(4, 1, 4)
    rows = routing_flatness(logits, top_k=1, phase=torch.tensor([0, 0, 1, 1]))
    assert [r["phase"] for r in rows] == ["all", "prefill", "decode"]
    assert [r["tokens"] for r in rows] == [4, 2, 2]
    with pytest.raises(ValueError, match="top_k"):
        routing_flatness(logits)


def test_adjacent_cosine_baseline_pairs_different_tokens():
    from fate_lab.study.analysis import adjacent_cosine_baseline

    # token t's layer-1 vector equals its layer-0 vector, so same-token cosine is 1; tokens are
    # orthogonal to each other, so any different-token pairing gives exactly 0
    eye = torch.eye(4)
    g = torch.stack([eye, eye], dim=1)  # (N=4, L=2, H=4)
    assert adjacent_cosine_baseline(g)[0]["cosine"] == pytest.approx(0.0)
