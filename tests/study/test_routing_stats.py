"""Routing statistics on hand-built routings with exact expected numbers."""
import math

import pytest
import torch

from fate_lab.study.routing_stats import predictor_recall, reuse_distance, summary, transition_entropy


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


def test_the_summary_table_by_hand():
    from fate_lab.core.shape import ModelShape
    from fate_lab.model.trace import from_routing_array

    # two layers, k=1, E=4, one prompt, all decode; layer 0 -> layer 1 is deterministic (0 -> 2, 1 -> 3)
    ex = torch.tensor([[[0], [2]], [[0], [2]], [[1], [3]], [[0], [2]]])
    shape = ModelShape(2, 2, 4, 1, 16, 16, torch.float32, 0, 0)
    s = summary(from_routing_array(ex, num_experts=4), shape, recall=False)
    h = -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))  # layer 1 uses 2 three times in four, 3 once
    assert s.loc["H(next layer's expert), mean over layer pairs", "bits"] == pytest.approx(h)
    assert s.loc["H(uniform choice of an expert)", "bits"] == 2.0
    assert s.loc["H(next | one current expert)", "bits"] == pytest.approx(0.0, abs=1e-12)
    mi = s.loc["mutual information, current -> next layer"]
    assert (mi["bits"], mi["share"]) == (pytest.approx(h), pytest.approx(1.0))
    # each layer: a a b a -> the first a is reused 1 later, the second 2 later, b and the last a never again
    assert s.loc["decode uses reused by the next token", "share"] == 0.25
    assert s.loc["decode uses reused within 4 tokens", "share"] == 0.5
    assert s.loc["decode uses never used again in the prompt", "share"] == 0.5
    assert not any(i.startswith("decode recall") for i in s.index)
    assert math.isnan(s.loc["decode uses reused by the next token", "bits"])  # a row has bits or a share


def test_the_summary_recall_rows_are_predictor_recall_on_a_recorded_trace():
    from helpers import prompt_ids

    from fate_lab.core.shape import ModelShape
    from fate_lab.model.adapters import adapt
    from fate_lab.model.record import record_trace
    from fate_lab.model.testing import tiny_model

    model = tiny_model("olmoe", seed=6)
    prompts = [prompt_ids(model.config.vocab_size, n=8, seed=s)[0].tolist() for s in range(3)]
    trace = record_trace(model, None, prompts, decode_tokens=6, progress=False)
    shape = ModelShape.from_adapter(adapt(model))
    calib, ev = trace.subset(trace.prompt_id == 0), trace.subset(trace.prompt_id > 0)
    s = summary(ev, shape, calib)
    pr = predictor_recall(ev, shape, calib).set_index("predictor")["decode recall"]
    assert len(pr) == 4
    for name, r in pr.items():
        assert s.loc[f"decode recall at set size k: {name}", "share"] == r and 0.0 <= r <= 1.0
