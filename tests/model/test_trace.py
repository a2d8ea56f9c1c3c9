"""Trace recorder: teacher forcing, agreement with the model's own routing, format round trip."""
import numpy as np
import pytest
import torch

from fate_lab.model.adapters import adapt
from fate_lab.model.record import record_trace
from fate_lab.model.testing import tiny_model
from fate_lab.model.trace import DECODE, PREFILL, Trace, cross_layer_scores, from_routing_array

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


# --- from_routing_array: prompts from lengths, dtypes, checks ----------------------------------
def _distinct_routing(n: int, layers: int, k: int, num_experts: int, dtype=torch.int64, seed: int = 0) -> torch.Tensor:
    """[n, layers, k] ids with k distinct experts per row: a random start plus 0..k-1, modulo E."""
    start = torch.randint(0, num_experts, (n, layers, 1), generator=torch.Generator().manual_seed(seed))
    return ((start + torch.arange(k)) % num_experts).to(dtype)  # (n, layers, k)


def test_from_routing_array_lengths_give_prompt_ids_and_positions():
    arr = _distinct_routing(5, 2, 2, 4)
    t = from_routing_array(arr, num_experts=4, lengths=[2, 3])
    assert t.prompt_id.tolist() == [0, 0, 1, 1, 1] and t.position.tolist() == [0, 1, 0, 1, 2]
    t = from_routing_array(arr, num_experts=4, lengths=[2, 0, 3])  # an empty prompt keeps its number
    assert t.prompt_id.tolist() == [0, 0, 2, 2, 2] and t.position.tolist() == [0, 1, 0, 1, 2]
    # prompt_id may interleave prompts; positions count each prompt's rows in order
    t = from_routing_array(arr, num_experts=4, prompt_id=[1, 0, 1, 0, 0])
    assert t.position.tolist() == [0, 0, 1, 1, 2]
    t = from_routing_array(arr, num_experts=4, prompt_id=[0, 0, 3, 3, 3])  # grouped rows: positions without a sort
    assert t.position.tolist() == [0, 1, 0, 1, 2]
    with pytest.raises(ValueError, match=r"lengths must sum to the routing array's 5 tokens; got sum 4"):
        from_routing_array(arr, num_experts=4, lengths=[2, 2])
    with pytest.raises(ValueError, match=r"lengths must be non-negative.*got -1 for prompt 1"):
        from_routing_array(arr, num_experts=4, lengths=[6, -1])
    with pytest.raises(TypeError, match=r"lengths must be .*got dtype torch.float32"):
        from_routing_array(arr, num_experts=4, lengths=[2.5, 2.5])
    with pytest.raises(ValueError, match=r"either lengths .* or prompt_id"):
        from_routing_array(arr, num_experts=4, lengths=[5], prompt_id=[0] * 5)


def test_from_routing_array_on_a_large_array():
    """A real tool's size (speed is a benchmark matter: ~0.05 s here, not asserted)."""
    n, layers, k, e, prompts = 180_000, 26, 6, 64, 1000  # 180 tokens per prompt
    arr = _distinct_routing(n, layers, k, e, dtype=torch.int8)
    t = from_routing_array(arr, num_experts=e, lengths=[n // prompts] * prompts, phase="decode")
    assert t.experts.dtype == torch.int8 and t.num_tokens == n
    assert t.position[[0, 179, 180, -1]].tolist() == [0, 179, 0, 179]
    assert t.prompt_id[[0, 179, 180, -1]].tolist() == [0, 0, 1, prompts - 1]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_from_routing_array_keeps_integer_dtype_through_save_and_load(dtype, tmp_path):
    arr = _distinct_routing(6, 3, 2, 8, dtype=dtype)
    t = from_routing_array(arr, num_experts=8)
    assert t.experts.dtype == dtype and t.experts.tolist() == arr.tolist()
    back = Trace.load(t.save(tmp_path / "t.safetensors"))
    assert back.experts.dtype == dtype and back.experts.tolist() == arr.tolist() and back.num_experts == 8


def test_from_routing_array_numpy_ids_keep_their_width():
    np = pytest.importorskip("numpy")
    arr = np.array([[[0, 1], [2, 3]], [[1, 0], [3, 2]]], dtype=np.int16)
    assert from_routing_array(arr, num_experts=4).experts.dtype == torch.int16
    wide = from_routing_array(arr.astype(np.uint16), num_experts=4)  # torch has no min/max for uint16
    assert wide.experts.dtype == torch.int32 and wide.experts.tolist() == arr.tolist()


def test_from_routing_array_warns_when_num_experts_is_inferred():
    import warnings

    arr = [[[0, 1], [2, 3]], [[1, 0], [3, 2]]]
    with pytest.warns(UserWarning, match=r"num_experts not given: inferred as the largest expert id \+ 1 = 4"):
        t = from_routing_array(arr)
    assert t.num_experts == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_routing_array(arr, num_experts=16).num_experts == 16
        assert from_routing_array(arr, meta={"num_experts": 16}).num_experts == 16


def test_from_routing_array_refuses_bad_ids():
    ok = [[[0, 1], [2, 3]], [[1, 0], [3, 2]], [[0, 2], [1, 3]]]
    with pytest.raises(TypeError, match=r"routing must hold integer expert ids, got dtype torch.float32"):
        from_routing_array(torch.tensor(ok, dtype=torch.float32), num_experts=4)
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, num_experts=4\); got -1 at token 1, layer 1"):
        from_routing_array([[[0, 1], [2, 3]], [[1, 0], [-1, 2]]], num_experts=4)
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, num_experts=3\); got 3 at token 0, layer 1"):
        from_routing_array(ok, num_experts=3)
    with pytest.raises(ValueError, match=r"k=2 experts per token and layer but num_experts=1"):
        from_routing_array([[[0, 0]]], num_experts=1)
    with pytest.raises(TypeError, match=r"num_experts must be a positive int, got 4\.0"):
        from_routing_array(ok, num_experts=4.0)
    with pytest.raises(ValueError, match=r"num_experts must be a positive int, got 0"):
        from_routing_array(ok, num_experts=0)


def test_from_routing_array_refuses_duplicate_experts_in_a_row():
    arr = _distinct_routing(5, 3, 4, 8)
    arr[3, 0, 2] = arr[3, 0, 0]  # later in row order
    arr[2, 1, 3] = arr[2, 1, 1]  # the first offending (token, layer)
    with pytest.raises(ValueError, match=r"repeats an expert id.*token 2, layer 1.*2 such rows"):
        from_routing_array(arr, num_experts=8)
    wide = _distinct_routing(4, 2, 20, 32)  # k above the pairwise limit: the sort path
    wide[1, 1, 19] = wide[1, 1, 0]
    with pytest.raises(ValueError, match=r"repeats an expert id.*token 1, layer 1"):
        from_routing_array(wide, num_experts=32)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8])
def test_the_compiled_duplicate_scan_equals_a_set_per_row(dtype):
    from fate_lab.model.routing_scan import duplicate_rows

    rng = np.random.default_rng(0)
    # ids below 64 (a row is one bit mask) and up to 200 (rows with an id of 64 or more compare pairwise)
    for k, E in [(k, E) for k in (2, 6, 16) for E in (40, min(200, np.iinfo(dtype).max + 1))]:
        a = rng.integers(0, E, size=(50, 3, k)).astype(dtype)  # many rows repeat an id, some do not
        bad = [(n, l) for n in range(50) for l in range(3) if len(set(a[n, l].tolist())) < k]  # the reference
        assert duplicate_rows(a) == ((len(bad), *bad[0]) if bad else (0, -1, -1))


def test_from_routing_array_phase_names_and_values():
    arr = _distinct_routing(3, 2, 2, 4)
    assert from_routing_array(arr, num_experts=4, phase="prefill").phase.tolist() == [PREFILL] * 3
    assert from_routing_array(arr, num_experts=4).phase.tolist() == [DECODE] * 3
    named = from_routing_array(arr, num_experts=4, phase=["prefill", "decode", "decode"])
    assert named.phase.tolist() == [PREFILL, DECODE, DECODE]
    with pytest.raises(ValueError, match=r"phase must hold 0 \(prefill\) or 1 \(decode\); got 2 at row 1"):
        from_routing_array(arr, num_experts=4, phase=[0, 2, 1])
    with pytest.raises(ValueError, match=r"phase must be None, 'prefill', 'decode'.*got 'warmup'"):
        from_routing_array(arr, num_experts=4, phase="warmup")
    with pytest.raises(ValueError, match=r"phase must have shape \(3,\)"):
        from_routing_array(arr, num_experts=4, phase=[0, 1])


def test_trace_refuses_phase_outside_prefill_and_decode():
    z = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"Trace.phase must hold 0 \(prefill\) or 1 \(decode\); got 7 at row 2"):
        Trace(experts=torch.zeros(3, 1, 1, dtype=torch.int64), token_ids=z, phase=torch.tensor([0, 1, 7]),
              prompt_id=z, position=z)


@pytest.mark.parametrize("raw, pattern", [
    ("not json", r"metadata is not valid JSON"),
    ("[1, 2]", r"metadata must be a JSON object.*got a JSON list"),
    ("null", r"metadata must be a JSON object.*got a JSON NoneType"),
    ('{"format_version": "1"}', r"format_version must be a non-negative integer.*got '1'"),
    ('{"format_version": 1, "num_experts": -4}', r"num_experts must be a positive integer, got -4"),
])
def test_load_rejects_malformed_metadata(tmp_path, raw, pattern):
    from safetensors.torch import save_file

    t = from_routing_array(_distinct_routing(2, 1, 2, 4), num_experts=4)
    tensors = {n: getattr(t, n).contiguous() for n in ("experts", "token_ids", "phase", "prompt_id", "position")}
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={"fate_lab_trace": raw})
    with pytest.raises(ValueError, match=pattern):
        Trace.load(tmp_path / "bad.safetensors")


def test_load_names_missing_tensors(tmp_path):
    from safetensors.torch import save_file

    save_file({"experts": torch.zeros(2, 1, 1, dtype=torch.int64)}, str(tmp_path / "partial.safetensors"),
              metadata={"fate_lab_trace": '{"format_version": 1}'})
    with pytest.raises(ValueError, match=r"tensors \['token_ids', 'phase', 'prompt_id', 'position'\] are missing"):
        Trace.load(tmp_path / "partial.safetensors")


def test_a_router_bias_is_recorded_and_reproduces_the_model_s_own_routers(tmp_path):
    """gpt-oss's router adds a logit bias: the trace keeps it (through save/load), and the trace's routers score
    every gate input bit for bit as the runtime's `host_routers()` do."""
    from fate_lab.model.trace import router_scores

    model = tiny_model("gpt_oss", seed=1)
    adapter = adapt(model)
    trace = record_trace(model, None, [[5, 6, 7, 8]], decode_tokens=3, progress=False)
    assert trace.router_biases is not None
    assert trace.router_biases.shape == (adapter.num_moe_layers, adapter.num_experts)
    loaded = Trace.load(trace.save(tmp_path / "t.safetensors", gate_dtype=torch.float32))
    assert torch.equal(loaded.router_biases, trace.router_biases) and loaded.meta["router_linear"] is True
    mine, theirs = adapter.host_routers(), router_scores(loaded)
    for m in range(adapter.num_moe_layers):
        gi = loaded.gate_inputs[:, m]
        assert torch.equal(mine.scores(m, gi), theirs.scores(m, gi))
    without = Trace.load(trace.save(tmp_path / "u.safetensors", gate_dtype=torch.float32))
    without.router_biases = None  # what a simulator without the bias would predict: not the runtime's scores
    gi0 = loaded.gate_inputs[:, 0]
    assert not torch.equal(mine.scores(0, gi0), router_scores(without).scores(0, gi0))


def test_bf16_linear_routers_stay_linear_and_a_normalising_one_does_not():
    """A bf16 router's product differs from the fp32 one by bf16 rounding: still a weight product (the simulator
    reproduces it from the trace), while Gemma 4's normalised, scaled input never is."""
    assert adapt(tiny_model("qwen2_moe", dtype=torch.bfloat16)).host_routers().is_linear(0)
    assert not adapt(tiny_model("gemma4_text", dtype=torch.bfloat16)).host_routers().is_linear(0)


@pytest.mark.parametrize("grouped", [True, False])
def test_positions_match_a_count_of_each_prompts_earlier_rows(grouped):
    g = torch.Generator().manual_seed(3)
    pid = torch.randint(0, 7, (400,), generator=g)
    if grouped:
        pid = torch.sort(pid).values
    seen: dict[int, int] = {}
    expected = []
    for p in pid.tolist():  # brute force: how many rows of the same prompt came before
        expected.append(seen.get(p, 0))
        seen[p] = expected[-1] + 1
    t = from_routing_array(_distinct_routing(400, 1, 2, 4), num_experts=4, prompt_id=pid)
    assert t.position.tolist() == expected
