"""The learned cross-layer predictor: probes, their file, the threshold rule and its tuning, on synthetic traces."""
import math

import pytest
import torch

from fate_lab.fit.probes import (
    compare_with_percentile,
    fit_probes,
    percentile_recall,
    threshold_for_recall,
    train_prompts,
    tune_thresholds,
)
from fate_lab.model.trace import DECODE, PREFILL, Trace
from fate_lab.policy.prediction_metrics import evaluate_rule
from fate_lab.policy.probes import LearnedGate, ProbeSet, Threshold, load_probes

L, H, K = 3, 8, 2  # synthetic model: 3 MoE layers, gate inputs of width 8, top-2 ...
E = 2 * K  # ... of 4 experts in K pairs: exactly one expert of each pair is routed to


def separable_trace(n: int = 600, seed: int = 0) -> Trace:
    """Layer l+1 routes to expert 2j or 2j+1 by the sign of a_j . z_l, z_l the standardised gate input of layer l.

    So each expert's membership is a linear function of x_l (x = 3 + 2 z: the probes must undo the
    offset and scale); rows with |a_j . z| < 0.5 are dropped, leaving a margin. Layer 0 routes by
    its own input, rows alternate prefill/decode, prompts of 10 rows.
    """
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(L, K, H, generator=g)
    a = a / a.norm(dim=-1, keepdim=True)  # (L, K, H) unit directions
    z = torch.randn(20 * n, L, H, generator=g)  # (M, L, H)
    proj = torch.einsum("mlh,lkh->mlk", z, a)  # (M, L, K) proj[:, l] decides layer l+1 (l+1 < L), and layer 0
    keep = (proj.abs() > 0.5).flatten(1).all(-1).nonzero().flatten()[:n]
    z, proj = z[keep], proj[keep]  # (n, L, H), (n, L, K)
    experts = torch.empty(n, L, K, dtype=torch.long)
    pick = lambda p: 2 * torch.arange(K) + (p < 0).long()  # noqa: E731 (n, K) expert 2j if positive else 2j+1
    experts[:, 0] = pick(proj[:, L - 1])  # layer 0: any valid routing (the last layer's directions)
    for l in range(L - 1):
        experts[:, l + 1] = pick(proj[:, l])
    idx = torch.arange(n)
    return Trace(experts=experts, token_ids=torch.zeros(n, dtype=torch.long), phase=idx % 2, prompt_id=idx // 10,
                 position=idx % 10, gate_inputs=3.0 + 2.0 * z, router_weights=torch.randn(L, E, H, generator=g),
                 meta={"num_experts": E})


@pytest.fixture(scope="module")
def trace() -> Trace:
    return separable_trace()


@pytest.fixture(scope="module")
def linear(trace) -> ProbeSet:
    return fit_probes(trace, hidden=0, C=100.0, progress=False)


def true_mask(trace: Trace) -> torch.Tensor:
    """[N, L-1, E] experts of layer l+1."""
    return torch.zeros(trace.num_tokens, L - 1, E, dtype=torch.bool).scatter_(-1, trace.experts[:, 1:], True)


def test_threshold_rule_on_known_scores():
    s = torch.tensor([[0.9, 0.6, 0.3, 0.1], [0.5, 0.5, 0.2, 0.05]])
    assert Threshold(0.35).ids(s) == [[0, 1], [0, 1]]
    assert Threshold(0.55).ids(s) == [[0, 1], [0]]  # nothing >= 0.55 in row 1: its best, ties by lower id
    assert Threshold(0.95).select(s).tolist() == [[True, False, False, False], [True, False, False, False]]
    assert [Threshold(0.35).count(r) for r in s.tolist()] == [2, 2]
    assert Threshold(0.55).ids_row(s[1].tolist()) == [0]


def test_threshold_for_recall_is_the_largest_that_reaches_the_target():
    s = torch.tensor([[0.9, 0.6, 0.3, 0.1], [0.5, 0.4, 0.2, 0.05]])
    true = torch.tensor([[True, False, True, False], [False, True, False, True]])
    # reach of the true experts: inf (row 0's best, kept by the fallback), 0.3, 0.4, 0.05
    assert threshold_for_recall(s, true, 0.25) == 1.0  # the fallback alone finds 1 of 4
    assert threshold_for_recall(s, true, 0.5) == pytest.approx(0.4)
    assert threshold_for_recall(s, true, 0.75) == pytest.approx(0.3)
    assert threshold_for_recall(s, true, 1.0) == pytest.approx(0.05)
    for target in (0.25, 0.5, 0.75, 1.0):
        hit = Threshold(threshold_for_recall(s, true, target)).select(s) & true
        assert hit.sum().item() / 4 >= target
    with pytest.raises(ValueError, match="one shape"):
        threshold_for_recall(s, true[:1], 0.5)


def test_linear_probes_recover_a_linear_routing_exactly(trace, linear):
    assert (linear.kind, linear.num_layers, linear.num_experts, linear.hidden_size) == ("linear", L, E, H)
    scores = linear.trace_scores(trace.gate_inputs)  # (N, L-1, E)
    true = true_mask(trace)
    p = threshold_for_recall(scores, true, 1.0)
    pred = Threshold(p).select(scores.reshape(-1, E)).reshape(true.shape)
    assert (pred == true).all()  # recall 1.0 with exactly the K true experts per token and layer
    res = evaluate_rule(scores, trace.experts, Threshold(p))["all"]
    assert (res["recall"], res["precision"], res["mean_set_size"]) == (1.0, 1.0, K)


def test_mlp_probes_learn_the_same_routing():
    trace = separable_trace(4000)  # Adam with early stopping needs more than a few hundred rows
    mlp = fit_probes(trace, hidden=16, alpha=1e-4, progress=False)
    assert mlp.kind == "mlp" and mlp.hidden_weight.shape == (L - 1, 16, H)
    res = evaluate_rule(mlp.trace_scores(trace.gate_inputs), trace.experts, Threshold(0.5))["all"]
    assert res["recall"] >= 0.99 and res["mean_set_size"] <= K + 0.05


def test_fit_is_deterministic(trace, linear):
    again = fit_probes(trace, hidden=0, C=100.0, progress=False)
    assert torch.equal(again.weight, linear.weight) and torch.equal(again.bias, linear.bias)


def test_save_load_round_trip_gives_identical_scores(tmp_path, trace, linear):
    tuned = tune_thresholds(linear, trace)
    mlp = tune_thresholds(fit_probes(trace, hidden=8, dtype=torch.float16, progress=False), trace)
    for probes in (tuned, mlp):
        path = probes.save(tmp_path / f"{probes.kind}.safetensors")
        back = ProbeSet.load(path)
        assert path.with_suffix(".json").exists()
        assert back.weight.dtype == probes.weight.dtype and torch.equal(back.thresholds, probes.thresholds)
        assert torch.equal(back.trace_scores(trace.gate_inputs), probes.trace_scores(trace.gate_inputs))
        assert back.meta["tuning"]["match"] == "overall" and back.meta["hidden"] == probes.meta["hidden"]


def test_tuned_thresholds_reach_the_percentile_recall_on_their_trace(trace, linear):
    scores = linear.trace_scores(trace.gate_inputs)
    targets = percentile_recall(trace)
    for match in ("overall", "layer"):
        tuned = tune_thresholds(linear, trace, match=match)
        assert tuned.thresholds.shape == (2, L - 1)
        for i, (name, code) in enumerate((("prefill", PREFILL), ("decode", DECODE))):
            rows = trace.phase == code
            per_layer = [evaluate_rule(scores[rows, l : l + 1], trace.experts[rows, l : l + 2],
                                       Threshold(float(tuned.thresholds[i, l])))["all"]["recall"] for l in range(L - 1)]
            if match == "overall":
                assert tuned.thresholds[i].unique().numel() == 1
                assert sum(per_layer) / (L - 1) >= targets[name]["overall"] - 1e-6
            else:
                assert all(r >= t - 1e-6 for r, t in zip(per_layer, targets[name]["per_layer"], strict=True))
            # the largest such threshold: one step above it misses the target
            up = math.nextafter(float(tuned.thresholds[i, 0]), 2.0)
            if match == "layer" and up <= 1.0:
                r = evaluate_rule(scores[rows, :1], trace.experts[rows, :2], Threshold(up))["all"]["recall"]
                assert r < targets[name]["per_layer"][0]


def test_learned_gate_picks_thresholds_by_phase_and_unites_a_prefill():
    w = torch.tensor([[[10.0, 0.0], [0.0, 10.0], [-10.0, 0.0], [0.0, -10.0]]])  # (1, 4, 2): scores sigmoid(+-10 x)
    probes = ProbeSet(weight=w, bias=torch.zeros(1, 4), thresholds=torch.tensor([[0.5], [0.9]]))
    gate = LearnedGate(probes)
    x = torch.tensor([0.1, 0.3])  # scores 0.731, 0.953, 0.269, 0.047
    assert gate.predict(0, gate.scores(0, x)[0], torch.tensor([0, 1])) == [1]  # one row: decode, p=0.9
    gate.set_phase("prefill")
    assert gate.predict(0, gate.scores(0, x)[0], torch.tensor([0, 1])) == [1, 0]
    gate.set_phase(None)
    xs = torch.tensor([[0.1, 0.3], [-0.2, 0.05]])  # row 2: 0.119, 0.622, 0.881, 0.378
    # prefill, p=0.5: {1, 0} and {2, 1}; 1 twice, then 2 before 0 by summed score (0.881 > 0.731)
    assert gate.predict(0, gate.scores(0, xs), torch.tensor([[0, 1], [0, 1]])) == [1, 2, 0]
    assert gate.rule_for(0, "decode") == Threshold(0.8999999761581421)
    with pytest.raises(ValueError, match="next_scores"):
        gate.predict(0, None, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="phase"):
        gate.set_phase("verify")
    with pytest.raises(IndexError, match="no probe for layer 1"):
        gate.predict(1, gate.scores(0, x)[0], torch.tensor([0, 1]))


def test_compare_with_percentile_table(trace, linear):
    table = compare_with_percentile(tune_thresholds(linear, trace), trace, reps=3)
    assert list(table["layer"]) == [1, 2, "all"] * 2 and list(table["phase"][::3]) == ["prefill", "decode"]
    overall = table[table["layer"] == "all"]
    assert (overall["eq_recall"] >= overall["pct_recall"] - 1e-6).all()
    assert torch.allclose(torch.tensor(table["size_ratio"].values),
                          torch.tensor((table["eq_set_size"] / table["pct_set_size"]).values))
    assert (table[["probe_score_us", "gate_score_us", "probe_predict_us", "gate_predict_us"]] > 0).all().all()


def test_train_prompts_come_from_training_documents_only():
    from fate_lab.model.corpus import load_corpus

    prompts = train_prompts(24, seed=3)
    assert prompts == train_prompts(24, seed=3) and prompts[:10] == train_prompts(10, seed=3)
    assert len(set(prompts)) == 24
    train = [d["text"] for d in load_corpus(split="train")]
    held = [d["text"] for d in load_corpus(split="val")]
    for p in prompts:
        assert any(p in t for t in train) and not any(p in t for t in held)


def test_errors_name_the_problem(tmp_path, trace, linear):
    with pytest.raises(ValueError, match="weight must be"):
        ProbeSet(weight=torch.zeros(4, 8), bias=torch.zeros(4))
    with pytest.raises(ValueError, match="bias must be"):
        ProbeSet(weight=torch.zeros(2, 4, 8), bias=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="hidden_weight must be"):
        ProbeSet(weight=torch.zeros(2, 4, 6), bias=torch.zeros(2, 4), hidden_weight=torch.zeros(2, 5, 8),
                 hidden_bias=torch.zeros(2, 6))
    with pytest.raises(ValueError, match="both hidden_weight and hidden_bias"):
        ProbeSet(weight=torch.zeros(2, 4, 6), bias=torch.zeros(2, 4), hidden_weight=torch.zeros(2, 6, 8))
    with pytest.raises(ValueError, match="thresholds must be"):
        ProbeSet(weight=torch.zeros(2, 4, 8), bias=torch.zeros(2, 4), thresholds=torch.zeros(2))
    with pytest.raises(ValueError, match=r"gate_input must be \[T, 8\]"):
        linear.scores(0, torch.zeros(3, 7))
    with pytest.raises(IndexError, match="out of range"):
        linear.scores(L - 1, torch.zeros(1, H))
    with pytest.raises(ValueError, match="gate_inputs must be"):
        linear.trace_scores(torch.zeros(5, L + 1, H))
    with pytest.raises(ValueError, match="fit probes for this model"):
        linear.check(L, 2 * E, H)
    with pytest.raises(ValueError, match="needs thresholds"):
        LearnedGate(linear)
    with pytest.raises(ValueError, match="no tuned thresholds"):
        linear.rule(0, "decode")
    with pytest.raises(ValueError, match="thresholds must be"):
        LearnedGate(linear, torch.zeros(2, L))
    with pytest.raises(ValueError, match="no gate inputs"):
        fit_probes(Trace(experts=trace.experts, token_ids=trace.token_ids, phase=trace.phase,
                         prompt_id=trace.prompt_id, position=trace.position, meta=trace.meta))
    with pytest.raises(ValueError, match="match must be"):
        tune_thresholds(linear, trace, match="token")
    with pytest.raises(FileNotFoundError, match="fate_lab fit-probes --model"):
        load_probes(tmp_path)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not fate_lab probes"):
        ProbeSet.load(tmp_path / "other.safetensors")
