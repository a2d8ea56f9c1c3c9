"""Expert similarity: exact hand examples of the pure policies, an identical copy scores the maximum,
the definition against a brute-force recomputation, save/load, and the file shipped with the tiny MoE."""
import json

import pytest
import torch

from fate_lab.fit.similarity import (
    compare_predictors,
    compute_similarity,
    least_squares_scale,
    output_moments,
    relative_error,
    weight_similarity,
)
from fate_lab.model.adapters import SUPPORTED_FAMILIES, adapt
from fate_lab.model.record import record_trace
from fate_lab.model.testing import tiny_model  # noqa: F401  (fixtures replace it where a test needs a fresh model)
from fate_lab.model.trace import from_routing_array
from fate_lab.paths import TINY_MOE_DIR
from fate_lab.policy.similarity import (
    FLOOR,
    SIMILARITY_FILE,
    ExpertSimilarity,
    expert_clusters,
    load_similarity,
    nearest,
    substitute,
)

# layer 0 of 4 experts; layer 1 is the same with rows and columns reversed
SIM0 = torch.tensor([[1.0, 0.5, 0.5, 0.2],
                     [0.1, 1.0, 0.3, 0.9],
                     [-0.4, -0.2, 1.0, -0.3],
                     [0.0, 0.7, 0.7, 1.0]])
SIM = torch.stack([SIM0, SIM0.flip(0, 1)])  # (2, 4, 4)


def test_substitute_hand_examples():
    assert substitute(SIM, 0, 1, {0, 2, 3}) == 3  # 0.9 beats 0.1 and 0.3
    assert substitute(SIM, 0, 1, {0, 2}) == 2
    assert substitute(SIM, 0, 0, {1, 2}) == 1  # tie 0.5 / 0.5: the lower id
    assert substitute(SIM, 0, 3, [2, 1]) == 1  # tie 0.7 / 0.7, given in any order: the lower id
    assert substitute(SIM, 0, 2, {0, 3}) == 3  # all negative: still the most similar
    assert substitute(SIM, 0, 2, {0, 3}, min_similarity=0.0) is None  # ... unless that is worse than dropping
    assert substitute(SIM, 0, 0, {1}, min_similarity=0.5) == 1  # the bound is inclusive
    assert substitute(SIM, 0, 1, set()) is None  # nothing resident
    assert substitute(SIM, 0, 1, {1, 3}) == 1  # e resident: nothing to substitute
    assert substitute(SIM, 1, 2, {0, 3}) == 0  # layer 1 = layer 0 reversed: expert 2 there is expert 1 here


def test_nearest_hand_examples():
    assert nearest(SIM, 0, 1, 3) == [3, 2, 0]
    assert nearest(SIM, 0, 0, 2) == [1, 2]  # tie by lower id; e itself never listed
    assert nearest(SIM, 0, 3, 10) == [1, 2, 0]  # k beyond E-1: every other expert
    assert nearest(SIM, 0, 2, 0) == []
    assert nearest(SIM, 1, 3, 1) == [1]  # the reverse of layer 0's expert 0 -> 1 (lower id of the tie)
    s = ExpertSimilarity(sim=SIM, routed=torch.zeros(2, 4, dtype=torch.int64))
    assert s.nearest(0, 1, 1) == [3] and s.substitute(0, 1, {0, 2}) == 2


def test_expert_clusters_hand_example():
    err = torch.full((4, 4), 1.5).fill_diagonal_(0.0)  # far apart ...
    err[0, 1], err[1, 0] = 0.1, 0.3  # ... but for 0 ~ 1 (symmetrised: 0.2)
    err[2, 3] = err[3, 2] = 0.4  # and 2 ~ 3
    sim = (1 - err)[None]  # (1, 4, 4)
    assert expert_clusters(sim, 0, max_error=0.5) == [[0, 1], [2, 3]]
    assert expert_clusters(sim, 0, max_error=0.3) == [[0, 1], [2], [3]]
    assert expert_clusters(sim, 0, max_error=0.1) == [[0], [1], [2], [3]]
    assert expert_clusters(sim, 0, max_error=2.0) == [[0, 1, 2, 3]]


def test_compare_predictors_hand_example():
    true_err = torch.tensor([[[0.0, 0.5, 1.5], [1.0, 0.0, 2.0], [0.9, 0.3, 0.0]]])  # (1, 3, 3)
    good = 1 - true_err  # ranks every row exactly right
    bad = true_err.clone()  # ranks every row backwards
    rows = compare_predictors({"good": good, "bad": bad}, true_err)
    r = rows[0]
    assert r["layer"] == 0 and rows[1]["layer"] == "mean"
    assert r["random"] == pytest.approx((0.5 + 1.5 + 1.0 + 2.0 + 0.9 + 0.3) / 6)
    assert r["oracle"] == pytest.approx((0.5 + 1.0 + 0.3) / 3)
    assert r["nearest by good"] == pytest.approx(r["oracle"])
    assert r["nearest by bad"] == pytest.approx((1.5 + 2.0 + 0.9) / 3)
    assert r["rank corr good"] == pytest.approx(1.0) and r["rank corr bad"] == pytest.approx(-1.0)


def _copy_model_and_trace():
    """A tiny qwen2_moe whose expert 5 is an exact copy of expert 3 in every MoE layer, and a trace."""
    model = tiny_model("qwen2_moe", seed=1)
    ad = adapt(model)
    with torch.no_grad():
        for m in range(ad.num_moe_layers):
            ex = ad.experts_module(m)
            ex.gate_up_proj[5] = ex.gate_up_proj[3]
            ex.down_proj[5] = ex.down_proj[3]
    prompts = [torch.randint(1, 128, (24,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    return model, record_trace(model, None, prompts, decode_tokens=8, progress=False)


@pytest.fixture(scope="module")
def copied():
    model, trace = _copy_model_and_trace()
    return model, trace, compute_similarity(model, trace, progress=False)


def test_identical_copy_has_the_maximum_similarity(copied):
    model, trace, s = copied
    assert s.sim.shape == (2, 8, 8) and s.routed.sum(1).tolist() == [trace.num_tokens * 2] * 2  # k = 2
    for m in range(s.num_layers):
        assert torch.all(s.sim[m].diagonal() == 1.0)
        assert s.sim[m, 3, 5] == 1.0 and s.sim[m, 5, 3] == 1.0  # exactly: the outputs are bitwise equal
        others = [f for f in range(8) if f not in (3, 5)]
        assert torch.all(s.sim[m, 3, others] < 1.0) and torch.all(s.sim[m, 5, others] < 1.0)
        assert s.nearest(m, 3, 1) == [5] and s.nearest(m, 5, 1) == [3]
        assert s.substitute(m, 3, {0, 5, 7}) == 5
        assert [3, 5] in s.clusters(m, max_error=1e-6)  # the only group at (almost) zero distance
        assert float(s.scale[m, 3, 5]) == pytest.approx(1.0, abs=1e-9)
    w = weight_similarity(model)
    assert w.shape == (2, 8, 8) and torch.allclose(w[:, 3, 5], torch.ones(2), atol=1e-6)


def test_definition_against_brute_force(copied):
    """err, sim and scale recomputed with the adapter's own expert math and plain loops."""
    model, trace, s = copied
    ad, floor = adapt(model), s.meta["floor"]
    for m in range(ad.num_moe_layers):
        x = trace.gate_inputs[:, m].half().float()  # (N, H) the fp16 rounding the trace file applies
        with torch.no_grad():
            y = torch.stack([ad.expert_forward(m, e, x).double() for e in range(8)])  # (E, N, H)
        for e in (0, 3, 6):
            w = (trace.experts[:, m] == e).any(-1).double() + floor  # (N,)
            own = (w * y[e].square().sum(-1)).sum()
            for f in range(8):
                diff = (w * (y[f] - y[e]).square().sum(-1)).sum()
                cross = (w * (y[f] * y[e]).sum(-1)).sum()
                other = (w * y[f].square().sum(-1)).sum()
                assert float(s.sim[m, e, f]) == pytest.approx(1 - float((diff / own).sqrt()), abs=1e-5)
                assert float(s.scale[m, e, f]) == pytest.approx(float(cross / other), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_every_family_matches_the_adapters_expert_math(family):
    model = tiny_model(family)
    trace = record_trace(model, None, [list(range(3, 15))], decode_tokens=3, progress=False)
    s = compute_similarity(model, trace, progress=False)
    ad = adapt(model)
    E = ad.num_experts
    assert s.sim.shape == (ad.num_moe_layers, E, E)
    for m in range(ad.num_moe_layers):
        x = trace.gate_inputs[:, m].half().float()  # (N, H)
        with torch.no_grad():
            y = torch.stack([ad.expert_forward(m, e, x).double() for e in range(E)])  # (E, N, H)
        w = torch.zeros(len(x), E, dtype=torch.float64).scatter_(1, trace.experts[:, m], 1.0) + FLOOR  # (N, E)
        diff = torch.einsum("ne,fenh->ef", w, (y[None] - y[:, None]).square())  # (E, E) [e, f]
        own = torch.einsum("ne,enh->e", w, y.square())  # (E,)
        torch.testing.assert_close(s.sim[m].double(), 1 - (diff / own[:, None]).sqrt(), atol=1e-5, rtol=0)


def test_scaled_error_and_max_tokens(copied):
    model, trace, s = copied
    mom = output_moments(model, trace, max_tokens=16, progress=False)
    assert mom["routed"].sum() == 16 * 2 * 2  # 16 tokens, 2 layers, k = 2
    scale = least_squares_scale(mom)
    scaled, plain = relative_error(mom, scale), relative_error(mom)
    assert torch.all(scaled <= plain + 1e-6)  # the least-squares factor never hurts on its own tokens
    assert torch.allclose(relative_error(mom, torch.ones_like(scale)), plain, atol=1e-5)  # factor 1: as-is


def test_save_load_round_trip(copied, tmp_path):
    _, _, s = copied
    path = s.save(tmp_path / SIMILARITY_FILE)
    back = load_similarity(tmp_path)
    assert torch.equal(back.sim, s.sim) and torch.equal(back.routed, s.routed) and torch.equal(back.scale, s.scale)
    assert back.meta["floor"] == s.meta["floor"] and back.meta["num_experts"] == 8
    assert json.loads(path.with_suffix(".json").read_text())["definition"] == s.meta["definition"]
    with pytest.raises(ValueError, match=r"\.safetensors"):
        s.save(tmp_path / "sim.pt")


def test_errors_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"python -m fate_lab fit-similarity --model"):
        load_similarity(tmp_path)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / SIMILARITY_FILE))
    with pytest.raises(ValueError, match="not a fate_lab expert similarity"):
        load_similarity(tmp_path)
    model = tiny_model("qwen2_moe")
    routing_only = from_routing_array(torch.zeros(4, 2, 2, dtype=torch.int64) + torch.tensor([0, 1]), num_experts=8)
    with pytest.raises(ValueError, match="no gate inputs"):
        compute_similarity(model, routing_only, progress=False)
    with pytest.raises(ValueError, match=r"must be \[layers, experts, experts\]"):
        ExpertSimilarity(sim=torch.zeros(2, 4, 3), routed=torch.zeros(2, 4))


@pytest.mark.skipif(not (TINY_MOE_DIR / SIMILARITY_FILE).is_file(), reason="shipped similarity not present")
def test_shipped_similarity_of_the_tiny_moe():
    s = load_similarity()
    assert s.sim.shape == (8, 32, 32) and s.scale.shape == (8, 32, 32)
    assert torch.all(s.sim.diagonal(dim1=1, dim2=2) == 1.0) and torch.all(s.sim < 1.0 + 1e-6)
    assert s.meta["trace"] == "lab.get_trace(split='calib')" and s.meta["tokens"] > 1000
    rows = s.meta["comparison_on_eval_trace"]
    assert rows[-1]["layer"] == "mean" and rows[-1]["rank corr outputs"] > rows[-1]["rank corr weights"]
    assert rows[-1]["nearest by outputs"] < rows[-1]["random"]
