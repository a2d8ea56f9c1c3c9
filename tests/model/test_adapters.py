"""adapters.py against the HF models themselves: routing, expert math, bytes, errors."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from fate_lab.model.adapters import SUPPORTED_FAMILIES, adapt, select_experts
from fate_lab.model.testing import tiny_model

# (id, family, overrides): every family, plus DeepSeek-V2's plain greedy router.
CASES = [(f, f, {}) for f in SUPPORTED_FAMILIES] + [("deepseek_v2-greedy", "deepseek_v2", {"topk_method": "greedy"})]
IDS = [c[0] for c in CASES]


def _capture(model, adapter, dtype=torch.float32):
    """Run a forward; return per MoE layer (gate input, HF router output, block in, block out)."""
    records = [dict() for _ in range(adapter.num_moe_layers)]
    handles = []
    for m in range(adapter.num_moe_layers):
        block = adapter.block(m)

        def gate_hook(mod, args, out, m=m):
            records[m]["gate_in"] = args[0].reshape(-1, adapter.hidden_size).detach().clone()  # (T, H)
            records[m]["router_out"] = tuple(t.detach().clone() for t in out)

        def block_hook(mod, args, out, m=m):
            records[m]["block_in"] = args[0].reshape(-1, adapter.hidden_size).detach().clone()  # (T, H)
            records[m]["block_out"] = out.reshape(-1, adapter.hidden_size).detach().clone()  # (T, H)

        handles += [block.gate.register_forward_hook(gate_hook), block.register_forward_hook(block_hook)]
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return records


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request):
    """(model, adapter, captured records) for one family, built once per module."""
    _, family, overrides = request.param
    model = tiny_model(family, seed=0, **overrides)
    adapter = adapt(model)
    return model, adapter, _capture(model, adapter)


def test_routing_matches_hf_router(case):
    model, adapter, records = case
    for m, rec in enumerate(records):
        hf_logits, hf_weights, hf_indices = rec["router_out"]
        logits, weights, indices = adapter.route(m, rec["gate_in"])
        assert torch.equal(indices, hf_indices), f"layer {m}: indices differ"
        assert weights.dtype == hf_weights.dtype
        torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(logits, hf_logits.float(), rtol=1e-6, atol=1e-6)
        assert logits.dtype == torch.float32


def test_routing_is_not_degenerate(case):
    """Tokens spread over experts, so the routing test above means something."""
    _, adapter, records = case
    used = torch.cat([adapter.route(m, r["gate_in"])[2].flatten() for m, r in enumerate(records)])
    assert used.unique().numel() >= min(adapter.num_experts, 4)


def test_recombined_experts_match_hf_block(case):
    _, adapter, records = case
    for m, rec in enumerate(records):
        x = rec["block_in"]  # (T, H)
        _, weights, indices = adapter.route(m, x)  # (T, k)
        out = torch.zeros_like(x)  # (T, H)
        for j in range(adapter.top_k):
            for e in indices[:, j].unique().tolist():
                rows = indices[:, j] == e  # (T,)
                out[rows] += weights[rows, j, None] * adapter.expert_forward(m, e, x[rows])
        shared = adapter.shared_forward(m, x)
        assert (shared is not None) == adapter.has_shared_experts
        if shared is not None:
            out = out + shared
        scale = rec["block_out"].abs().max()
        torch.testing.assert_close(out, rec["block_out"], rtol=1e-4, atol=1e-5 * float(scale))


def test_gate_input_hook_sees_router_input(case):
    model, adapter, records = case
    seen = {}
    handles = [adapter.gate_input_hook(m, lambda m, x: seen.__setitem__(m, x.clone()))
               for m in range(adapter.num_moe_layers)]
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    assert sorted(seen) == list(range(adapter.num_moe_layers))
    for m, rec in enumerate(records):
        assert seen[m].shape == (24, adapter.hidden_size)
        torch.testing.assert_close(seen[m], rec["gate_in"])


def test_layout_and_bytes(case):
    model, adapter, _ = case
    config = model.config
    layers = model.model.layers
    expected_moe = [i for i in range(len(layers)) if type(layers[i].mlp).__name__.endswith(("Moe", "MoE", "MoeBlock"))]
    assert adapter.moe_layers == expected_moe
    if adapter.family.startswith("deepseek"):
        assert adapter.moe_layers == list(range(config.first_k_dense_replace, config.num_hidden_layers))
    if adapter.family == "qwen3_moe":
        assert adapter.moe_layers == [0, 2]  # mlp_only_layers=[1]
    assert adapter.num_moe_layers == len(expected_moe)
    assert adapter.num_experts == layers[expected_moe[0]].mlp.experts.num_experts
    assert adapter.top_k == config.num_experts_per_tok

    inter, hidden = adapter.expert_intermediate_size, adapter.hidden_size
    assert adapter.bytes_per_expert() == 3 * inter * hidden * 4
    assert adapter.bytes_per_expert(torch.bfloat16) == 3 * inter * hidden * 2
    assert adapter.expert_bytes_total() == adapter.num_moe_layers * adapter.num_experts * adapter.bytes_per_expert()
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert adapter.dense_bytes() + adapter.expert_bytes_total() == sum(unique.values())
    summary = adapter.describe()
    assert summary["family"] == adapter.family and summary["moe_layers"] == adapter.moe_layers


def test_expert_weights_are_views(case):
    _, adapter, _ = case
    m, e = adapter.num_moe_layers - 1, adapter.num_experts - 1
    w = adapter.expert_weights(m, e)
    inter, hidden = adapter.expert_intermediate_size, adapter.hidden_size
    assert w["gate"].shape == (inter, hidden) and w["up"].shape == (inter, hidden)
    assert w["down"].shape == (hidden, inter)
    fused = adapter.experts_module(m)
    assert w["gate"].untyped_storage().data_ptr() == fused.gate_up_proj.untyped_storage().data_ptr()
    assert torch.equal(w["up"], fused.gate_up_proj[e, inter:])
    assert torch.equal(adapter.router_weight(m), adapter.block(m).gate.weight)


def test_kv_bytes_per_token_matches_hf_cache(case):
    model, adapter, _ = case
    cache = DynamicCache(config=model.config)
    tokens = 5
    with torch.no_grad():
        model(input_ids=torch.arange(tokens)[None], cache=cache, use_cache=True)
    stored = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values) if t is not None
    )
    assert adapter.kv_bytes_per_token() * tokens == stored


def test_tied_embeddings_counted_once():
    model = tiny_model("olmoe")  # the tiny OLMoE ties input and output embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    adapter = adapt(model)
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedups
    assert adapter.dense_bytes() + adapter.expert_bytes_total() == total


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v3"])
def test_routing_matches_hf_router_bf16(family):
    """dtype casts: Qwen casts top-k weights to bf16, Mixtral keeps fp32, DeepSeek routes in fp32."""
    model = tiny_model(family, dtype=torch.bfloat16)
    adapter = adapt(model)
    for m, rec in enumerate(_capture(model, adapter)):
        hf_logits, hf_weights, hf_indices = rec["router_out"]
        _, weights, indices = adapter.route(m, rec["gate_in"])
        assert torch.equal(indices, hf_indices)
        assert weights.dtype == hf_weights.dtype
        assert torch.equal(weights, hf_weights)


def test_select_experts_v3_group_limit_exact():
    """Hand-worked DeepSeek-V3 case: the best single expert sits in a dropped group."""
    spec = adapt(tiny_model("deepseek_v3")).router_spec
    # 8 experts, 4 groups of 2, keep 2 groups, pick 2. Sigmoid scores via logit(p).
    p = torch.tensor([[0.90, 0.01, 0.60, 0.55, 0.50, 0.50, 0.05, 0.05]])
    weights, indices = select_experts(spec, torch.logit(p), correction_bias=torch.zeros(8))
    # group sums: g0 .91, g1 1.15, g2 1.00, g3 .10 -> keep g1, g2 -> experts 2 and 3 (expert 0 excluded)
    assert sorted(indices[0].tolist()) == [2, 3]
    expected = torch.tensor([0.60, 0.55]) / 1.15 * 2.5
    torch.testing.assert_close(weights[0].sort(descending=True).values, expected)


@pytest.mark.parametrize("config_cls", [LlamaConfig])
def test_non_moe_model_rejected(config_cls):
    model = LlamaForCausalLM(config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError) as err:
        adapt(model)
    for family in SUPPORTED_FAMILIES:
        assert family in str(err.value)


def test_moe_family_without_moe_layers_rejected():
    model = tiny_model("qwen3_moe", mlp_only_layers=[0, 1, 2])
    with pytest.raises(ValueError, match="qwen2_moe"):
        adapt(model)
