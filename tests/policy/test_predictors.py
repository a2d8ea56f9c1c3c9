"""Selection rules, predictors and their metrics on hand-built cases."""
import pytest
import torch

from fate_lab.policy.prediction_metrics import evaluate_predictor, evaluate_rule, prefill_prediction
from fate_lab.policy.predictors import (
    ActivationMatrix,
    ActivationPath,
    CrossLayerGate,
    Oracle,
    PrevTokenSameLayer,
    RandomPredictor,
    SameTokenPrevLayer,
    activation_matrices,
)
from fate_lab.policy.rules import (
    CountBudget,
    CumulativeProb,
    Percentile,
    TopK,
    TopKPlus,
    cross_layer_scores,
    rule_from_name,
)

# ids:                 0     1     2     3     4     5     6     7
S = torch.tensor([[0.10, 0.30, 0.05, 0.20, 0.09, 0.15, 0.03, 0.08]])


def test_rules_on_a_known_distribution():
    assert TopK(2).ids(S) == [[1, 3]]
    assert TopKPlus(2, 1).ids(S) == [[1, 3, 5]]
    # 75th percentile of the 8 scores (linear): sorted[5.25] = 0.15 + 0.25 * 0.05 = 0.1625
    assert Percentile(75).ids(S) == [[1, 3]]
    # median: (0.09 + 0.10) / 2 = 0.095 -> 0.10, 0.15, 0.20, 0.30
    assert Percentile(50).ids(S) == [[1, 3, 5, 0]]
    # mass before 0.15 is 0.50 < 0.6 -> include; before 0.10 is 0.65 -> stop
    assert CumulativeProb(0.6).ids(S) == [[1, 3, 5]]
    assert CumulativeProb(0.01).ids(S) == [[1]]
    assert CountBudget(4).ids(S) == [[1, 3, 5, 0]]
    assert TopK(2).select(S).tolist() == [[False, True, False, True, False, False, False, False]]
    assert TopK(2).order(S)[0, :3].tolist() == [1, 3, 5]


def test_percentile_is_a_fixed_count():
    scores = torch.softmax(torch.randn(50, 60, generator=torch.Generator().manual_seed(0)), -1)
    assert Percentile(75).select(scores).sum(-1).tolist() == [15] * 50  # 15 of 60, whatever the shape


def test_rule_from_name():
    assert rule_from_name("topk_plus", k=4, alpha=1) == TopKPlus(4, 1)
    assert rule_from_name("percentile") == Percentile(75)
    with pytest.raises(ValueError, match="unknown selection rule"):
        rule_from_name("nope")


def test_cross_layer_scores():
    gi = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # (N=1, L=2, H=2)
    W = [torch.zeros(3, 2), torch.tensor([[5.0, 0.0], [0.0, 0.0], [-5.0, 0.0]])]
    s = cross_layer_scores(gi, W)  # layer 0's gate input x W[1]
    assert s.shape == (1, 1, 3) and s[0, 0].argmax() == 0
    assert torch.allclose(cross_layer_scores(gi, W, "sigmoid")[0, 0, 1], torch.tensor(0.5))


def test_evaluate_rule_by_hand():
    true = torch.tensor([[[0, 1], [0, 1]], [[0, 1], [2, 3]]])  # (N=2, L=2, k=2)
    scores = torch.tensor([[[0.4, 0.1, 0.3, 0.2]], [[0.1, 0.2, 0.3, 0.4]]])  # (N, L-1, E)
    r = evaluate_rule(scores, true, TopK(2), phase=torch.tensor([0, 1]))
    # token 0 predicts {0, 2} vs {0, 1}: recall 1/2, precision 1/2; token 1 predicts {3, 2}: 1, 1
    assert r["all"]["recall"] == pytest.approx(0.75)
    assert r["all"]["precision"] == pytest.approx(0.75)
    assert r["all"]["mean_set_size"] == 2
    assert r["prefill"]["recall"] == pytest.approx(0.5) and r["decode"]["recall"] == pytest.approx(1.0)
    assert r["all"]["per_layer"][0]["layer"] == 1
    r = evaluate_rule(scores, true, TopKPlus(2, 1))
    # {0, 2, 3}: recall 1/2, precision 1/3; {3, 2, 1}: recall 1, precision 2/3
    assert r["all"]["recall"] == pytest.approx(0.75)
    assert r["all"]["precision"] == pytest.approx(0.5)
    assert r["all"]["mean_set_size"] == 3
    assert r["prefill"] is None


def test_evaluate_rule_recall_uncertainty_by_hand():
    import math
    import statistics

    from fate_lab.study.verdict import mean_uncertainty

    true = torch.tensor([[[0, 1], [0, 1]], [[0, 1], [2, 3]], [[0, 1], [0, 1]]])  # (N=3, L=2, k=2)
    scores = torch.tensor([[[0.4, 0.1, 0.3, 0.2]], [[0.1, 0.2, 0.3, 0.4]], [[0.4, 0.3, 0.2, 0.1]]])
    r = evaluate_rule(scores, true, TopK(2))["all"]  # per-token recall 1/2, 1, 1
    assert r["per_token_recall"].tolist() == [0.5, 1.0, 1.0]
    assert mean_uncertainty(r["per_token_recall"].tolist()) == pytest.approx(
        2 * statistics.stdev([0.5, 1.0, 1.0]) / math.sqrt(3))
    # tokens 0-1 one prompt (mean 0.75), token 2 another (1.0): the prompt means' error 2 * 0.125 is smaller here
    assert mean_uncertainty(r["per_token_recall"].tolist(), [0, 0, 1]) == pytest.approx(
        2 * statistics.stdev([0.5, 1.0, 1.0]) / math.sqrt(3))
    # tokens 0 and 2 one prompt (0.75), token 1 alone (1.0), duplicated: prompt means 0.75, 1.0 -> 0.25
    r = evaluate_rule(scores[[0, 2, 1, 1]], true[[0, 2, 1, 1]], TopK(2))["all"]
    assert mean_uncertainty(r["per_token_recall"].tolist(), [0, 0, 1, 1]) == pytest.approx(
        max(2 * statistics.stdev([0.5, 1, 1, 1]) / 2, 0.25))
    one = evaluate_rule(scores[:1], true[:1], TopK(2))["all"]
    with pytest.raises(ValueError, match="at least 2"):  # one token: no spread
        mean_uncertainty(one["per_token_recall"].tolist())


BATCH = torch.tensor([[0.1, 0.5, 0.4, 0.0], [0.6, 0.3, 0.05, 0.05], [0.1, 0.2, 0.3, 0.4]])


def test_cross_layer_gate_single_and_batch():
    p = CrossLayerGate(TopK(2))
    assert p.predict(0, BATCH[0], torch.tensor([0, 1])) == [1, 2]
    # sets {1,2}, {0,1}, {3,2}: 1 and 2 twice (summed scores 0.8 > 0.7), then 0 (0.6), 3 (0.4)
    assert p.predict(0, BATCH, torch.zeros(3, 2, dtype=torch.long)) == [1, 2, 0, 3]
    with pytest.raises(ValueError, match="next_scores"):
        p.predict(0, None, torch.tensor([0, 1]))


def test_same_token_prev_layer():
    assert SameTokenPrevLayer().predict(0, None, torch.tensor([3, 1])) == [3, 1]
    assert SameTokenPrevLayer().predict(0, None, torch.tensor([[3, 1], [1, 2]])) == [1, 3, 2]


def test_prev_token_same_layer():
    p = PrevTokenSameLayer()
    assert p.predict(0, None, torch.tensor([0, 1])) == []  # no previous token yet
    p.observe(0, torch.tensor([0, 1]))
    p.observe(1, torch.tensor([2, 3]))
    p.observe(0, torch.tensor([0, 1]))  # next token, layer 0
    assert p.predict(0, None, torch.tensor([0, 1])) == [2, 3]
    p.reset()
    assert p.predict(0, None, torch.tensor([0, 1])) == []


def test_activation_path_from_history_and_online():
    hist = torch.tensor([[[0], [2]], [[0], [2]], [[0], [3]], [[1], [3]]])  # (N=4, L=2, k=1)
    p = ActivationPath(history=hist)
    assert p.predict(0, None, torch.tensor([0])) == [2]  # P(2|0) = 2/3
    assert p.predict(0, None, torch.tensor([1])) == [3]
    assert ActivationPath(n=2, history=hist).predict(0, None, torch.tensor([0])) == [2, 3]
    assert p.predict(0, None, torch.tensor([5])) == [2]  # unseen: most popular layer-1 experts (2 and 3 tie)
    q = ActivationPath(n=1)
    q.observe(0, torch.tensor([0]))
    q.observe(1, torch.tensor([2]))
    q.reset()  # keeps what was learned
    assert q.predict(0, None, torch.tensor([0])) == [2]


def test_random_predictor_is_seeded():
    a = [RandomPredictor(3, 10, seed=1).predict(0, None, torch.tensor([0])) for _ in range(2)]
    assert a[0] == a[1] and len(set(a[0])) == 3


def test_oracle_and_evaluate_predictor():
    ex = torch.tensor([[[0], [1]], [[2], [3]]])  # (N=2, L=2, k=1)
    o = Oracle(ex)
    assert o.predict(0, None, torch.tensor([0])) == [1]
    o.observe(0, torch.tensor([0]))
    o.observe(1, torch.tensor([1]))
    assert o.predict(0, None, torch.tensor([2])) == [3]
    r = evaluate_predictor(Oracle(ex), ex, num_experts=4)
    assert r["all"]["recall"] == 1.0 and r["all"]["precision"] == 1.0 and r["all"]["mean_set_size"] == 1


def test_evaluate_predictor_resets_per_prompt():
    ex = torch.tensor([[[0], [1]], [[0], [1]], [[0], [1]]])  # layer-1 expert always 1
    r = evaluate_predictor(PrevTokenSameLayer(), ex, prompt_id=torch.tensor([0, 0, 1]), phase=torch.tensor([0, 1, 0]),
                           num_experts=2)
    # t0: nothing to go on; t1: previous token's [1] -> recall 1; t2: new prompt, nothing
    assert r["all"]["recall"] == pytest.approx(1 / 3)
    assert r["all"]["mean_set_size"] == pytest.approx(1 / 3)
    assert r["decode"]["recall"] == 1.0 and r["prefill"]["recall"] == 0.0


def test_evaluate_predictor_matches_evaluate_rule():
    g = torch.Generator().manual_seed(0)
    scores = torch.softmax(torch.randn(20, 3, 6, generator=g), -1)
    ex = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(80)]).reshape(20, 4, 2)
    a = evaluate_rule(scores, ex, TopKPlus(2, 1))["all"]
    b = evaluate_predictor(CrossLayerGate(TopKPlus(2, 1)), ex, scores)["all"]
    assert a["recall"] == pytest.approx(b["recall"]) and a["precision"] == pytest.approx(b["precision"])


def test_prefill_prediction():
    true = torch.tensor([[[0], [1]], [[0], [1]], [[0], [2]]])  # (T=3, L=2, k=1): union {1, 2}
    r = prefill_prediction(BATCH.unsqueeze(1), true, TopK(2))
    row = r["per_layer"][0]
    assert row["predicted"] == [1, 2, 0, 3] and row["counts"] == [2, 2, 1, 1]
    assert (row["recall"], row["precision"], row["set_size"], row["true_set_size"]) == (1.0, 0.5, 4, 2)
    r = prefill_prediction(BATCH.unsqueeze(1), true, TopK(2), max_experts=2)
    assert r["per_layer"][0]["predicted"] == [1, 2] and r["precision"] == 1.0


def test_one_row_fast_path_equals_the_tensor_rules():
    """The decode path (plain Python over one row) picks the same ids as the batched tensor rules."""
    from fate_lab.policy.rules import CountBudget, CumulativeProb, Percentile, TopK, TopKPlus

    g = torch.Generator().manual_seed(0)
    rows = torch.softmax(torch.randn(300, 32, generator=g) * 2, -1)
    rows[0] = 1 / 32  # all equal: the percentile falls back to the single best
    rows[1, :8] = rows[1, 8]  # ties at the boundary go to the lower id
    for rule in (TopK(4), TopKPlus(4, 2), Percentile(75.0), Percentile(90.0), CountBudget(3), CumulativeProb(0.8)):
        assert [rule.ids_row(r) for r in rows.tolist()] == rule.ids(rows), rule


def test_activation_matrix_matches_the_most_similar_collected_request_by_hand():
    a = [[2, 0, 0, 0], [0, 3, 1, 0]]  # a request that used expert 0 in layer 0, then 1 (and 2) in layer 1
    b = [[0, 0, 2, 0], [0, 0, 0, 4]]  # one that used 2, then 3
    p = ActivationMatrix(2, 4, n=1, collection=torch.tensor([a, b]))
    p.reset()
    p.observe(0, torch.tensor([[2]]))  # this request so far looks like b (cosine 1 on layer 0, 0 on layer 1)
    assert p.predict(0, None, torch.tensor([2])) == [3]
    p.observe(0, torch.tensor([[0]]))  # now half a, half b (cosine 0.707 each): the first collected wins
    assert p.predict(0, None, torch.tensor([0])) == [1]
    p.n = 2
    assert p.predict(0, None, torch.tensor([0])) == [1, 2]
    with pytest.raises(ValueError, match=r"\[C, 2, 4\]"):
        ActivationMatrix(2, 4, collection=torch.zeros(1, 3, 4))


def test_activation_matrix_learns_online_from_finished_requests():
    p = ActivationMatrix(2, 4, n=2)
    p.observe(0, torch.tensor([[0, 1]]))
    p.observe(1, torch.tensor([[3, 1]]))
    assert p.predict(0, None, torch.tensor([0, 1])) == [1, 3]  # nothing collected: its own counts of layer 1
    p.reset()  # the request joins the collection
    p.observe(0, torch.tensor([[0, 1]]))
    assert p.predict(0, None, torch.tensor([0, 1])) == [1, 3]
    ex = torch.tensor([[[0], [1]], [[0], [2]], [[3], [3]]])  # [N=3, L=2, k=1]
    assert activation_matrices(ex, torch.tensor([0, 0, 1]), 4).tolist() == [[[2, 0, 0, 0], [0, 1, 1, 0]],
                                                                            [[0, 0, 0, 1], [0, 0, 0, 1]]]
