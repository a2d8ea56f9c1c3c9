"""Trace recorder: teacher forcing, agreement with the model's own routing, format round trip."""
import pytest
import torch

from fate_lab.adapters import adapt
from fate_lab.testing import tiny_model
from fate_lab.trace import DECODE, PREFILL, Trace, cross_layer_scores, from_routing_array, record_trace

FAMILIES = ["qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "deepseek_v2", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def recorded(request):
    model = tiny_model(request.param, seed=1)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 5)]
    trace = record_trace(model, None, prompts, decode_tokens=6, progress=False)
    return model, prompts, trace


def test_rows_and_phases(recorded):
    _, prompts, trace = recorded
    assert trace.num_tokens == sum(len(p) + 6 for p in prompts)
    assert trace.phase.tolist() == [PREFILL] * 7 + [DECODE] * 6 + [PREFILL] * 5 + [DECODE] * 6
    assert trace.position.tolist()[:13] == list(range(13))
    assert trace.token_ids.tolist()[:7] == prompts[0]


def test_decode_gate_inputs_match_teacher_forced_prefill(recorded):
    """Gate inputs recorded token by token equal a single prefill of the same tokens."""
    model, _, trace = recorded
    one = trace.subset(trace.prompt_id == 0)
    forced = record_trace(model, None, [one.token_ids.tolist()], decode_tokens=0, progress=False)
    assert forced.phase.eq(PREFILL).all()
    torch.testing.assert_close(forced.gate_inputs, one.gate_inputs, rtol=1e-4, atol=1e-4)
    assert torch.equal(forced.experts, one.experts)


def test_recorded_routing_equals_adapter_recomputation(recorded):
    model, _, trace = recorded
    ad = adapt(model)
    for m in range(trace.num_layers):
        logits, w, idx = ad.route(m, trace.gate_inputs[:, m])
        assert torch.equal(idx, trace.experts[:, m])
        torch.testing.assert_close(w.float(), trace.weights[:, m], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits.float(), trace.logits[:, m], rtol=1e-5, atol=1e-5)


def test_generated_tokens_equal_hf_generate(recorded):
    model, prompts, trace = recorded
    model.generation_config.eos_token_id = None  # random weights: do not stop at a chance EOS
    out = model.generate(torch.tensor([prompts[0]]), max_new_tokens=7, do_sample=False)
    assert out[0, len(prompts[0]):].tolist() == trace.meta["generated"][0]


def test_save_load_roundtrip(recorded, tmp_path):
    _, _, trace = recorded
    back = Trace.load(trace.save(tmp_path / "t.safetensors"))
    for name in ("experts", "token_ids", "phase", "prompt_id", "position"):
        assert torch.equal(getattr(back, name), getattr(trace, name))
    torch.testing.assert_close(back.logits, trace.logits)
    torch.testing.assert_close(back.gate_inputs, trace.gate_inputs, rtol=1e-3, atol=1e-3)  # stored as fp16
    assert back.meta["num_experts"] == trace.num_experts and back.meta["family"] == trace.meta["family"]


def test_load_rejects_plain_safetensors(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="not a fate_lab trace"):
        Trace.load(tmp_path / "x.safetensors")


def test_cross_layer_scores_brute_force(recorded):
    _, _, trace = recorded
    s = cross_layer_scores(trace)
    n, l = 3, 0
    x, W = trace.gate_inputs[n, l], trace.router_weights[l + 1]
    logits = torch.tensor([float((W[e] * x).sum()) for e in range(W.shape[0])])
    expected = logits.sigmoid() if trace.meta["scoring"] == "sigmoid" else logits.softmax(-1)
    torch.testing.assert_close(s[n, l], expected, rtol=1e-4, atol=1e-6)


def test_from_routing_array():
    arr = [[[0, 1], [2, 3]], [[1, 0], [3, 2]], [[0, 2], [1, 3]]]
    t = from_routing_array(arr, num_experts=4, prompt_id=[0, 0, 1])
    assert t.num_tokens == 3 and t.num_layers == 2 and t.top_k == 2 and t.num_experts == 4
    assert t.position.tolist() == [0, 1, 0]
    assert t.gate_inputs is None and t.logits is None
    with pytest.raises(ValueError, match=r"\[tokens, layers, k\]"):
        from_routing_array([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="expert ids must lie"):
        from_routing_array(arr, num_experts=3)
    with pytest.raises(ValueError, match="no gate inputs"):
        cross_layer_scores(t)
