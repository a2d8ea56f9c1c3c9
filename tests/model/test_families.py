"""Every experts-interface family of the installed transformers, against the HF modules themselves.

For each family whose tiny model builds here: (a) discovery (layers, E, k, H, I) against what the
model's own forward runs; (b) routing bit for bit against the router module's output, captured by a
forward hook during a real forward, and the host copy against the module; (c) the weighted sum of
`expert_apply` against the experts module's own output (eager: bit for bit, in fp32 and bf16; the
default grouped_mm kernel: within the float tolerance a different summation order allows); (d) one
expert at a time from tiny checkpoints against the module's tensors; (e) refusals naming what is missing.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from fate_lab.model import experts as ex
from fate_lab.model.adapters import adapt
from fate_lab.model.checkpoint import ExpertIndex, load_without_experts
from fate_lab.model.experts import combine_experts, expert_apply, expert_refusal, read_expert
from fate_lab.model.families import experts_interface_families, experts_interface_modules, text_tower_types
from fate_lab.model.routers import MissingRouterInput, select_experts
from fate_lab.model.testing import family_status, tiny_model

FAMILIES = experts_interface_families()  # causal LMs: every one builds and generates here
# Text towers of modules without a causal-LM class that build here (forward only); the family-table test
# checks that these, and only these, of `text_tower_types()` build (step3p5: step3p7's text model, transformers 5.25).
TOWERS = tuple(t for t in ("diffusion_gemma_text", "mistral4", "muse_spark_text", "openai_privacy_filter",
                           "qwen3_omni_moe_text", "qwen3_vl_moe_text", "step3p5", "unlimited_ocr_text")
               if t in text_tower_types().values())

# Routers `select_experts` (the pure model of a router) does not reproduce, each with the reason; the
# adapter still routes them exactly, by calling the module itself.
NOT_SELECT_EXPERTS = {
    "deepseek_v4": "scores with the module's own sqrt-softplus (score_fn)",
    "inkling_text": "scores shared experts beside the routed ones (E + shared columns) and returns their gammas",
    "kolibri1": "adds its correction bias to the raw logits, not to the sigmoid scores",
    "kolibri1_1": "kolibri1's router (transformers 5.25)",
    "longcat_flash": "scores zero (identity) experts beside the routed ones (E + zero_expert_num columns)",
    "phimoe": "sparsemixer weights (a masked softmax per selected expert), not a renormalised softmax",
    "zaya": "an MLP router with a 'skip' class and balancing biases over E + 1 classes",
}


def _capture(model, adapter, ids):
    """One eager forward; per MoE layer: the router call (args, kwargs, outputs) and the experts call."""
    records = [dict() for _ in range(adapter.num_moe_layers)]
    handles = []
    for m in range(adapter.num_moe_layers):
        def router_hook(mod, args, kwargs, out, m=m):
            records[m].setdefault("router", (args, kwargs, tuple(t.detach().clone() for t in out[:3])))

        def experts_hook(mod, args, out, m=m):
            records[m].setdefault("experts", (tuple(a.detach().clone() for a in args[:3]), out.detach().clone()))

        handles += [adapter.router(m).register_forward_hook(router_hook, with_kwargs=True),
                    adapter.experts_module(m).register_forward_hook(experts_hook)]
    model.set_experts_implementation("eager")
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return records


def _state_inputs(adapter, m, args, kwargs) -> dict:
    """The router inputs the gate input cannot supply, as the block passed them in the captured call."""
    site = adapter.router_site(m)
    names = list(inspect.signature(site.router.forward).parameters)
    return {n: (kwargs[n] if n in kwargs else args[names.index(n)]) for n in site.missing
            if n in kwargs or names.index(n) < len(args)}


@pytest.fixture(scope="module", params=FAMILIES + TOWERS)
def built(request):
    """(family, model, adapter, records) of one family's tiny fp32 model, built once per module."""
    family = request.param
    model = tiny_model(family, seed=0)
    adapter = adapt(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    return family, model, adapter, _capture(model, adapter, ids)


# --- (a) discovery -------------------------------------------------------------------------------
def test_discovery_matches_what_the_forward_runs(built):
    family, model, adapter, records = built
    ran = [m for m, r in enumerate(records) if "experts" in r]
    assert ran == list(range(adapter.num_moe_layers)), \
        f"{family}: MoE layers {set(range(adapter.num_moe_layers)) - set(ran)} never ran"
    layers = [i for i, layer in enumerate(getattr(model, "model", model).layers)
              if any(mod is adapter.experts_module(m) for mod in layer.modules()
                     for m in range(adapter.num_moe_layers))]
    assert adapter.moe_layers == layers
    for m, rec in enumerate(records):
        (hidden, idx, _), _ = rec["experts"]
        mod, layout = adapter.experts_module(m), adapter.layouts[m]
        assert layout.num_experts == mod.num_experts == adapter.num_experts
        assert idx.shape[-1] == adapter.top_k
        assert layout.hidden_size == hidden.shape[-1]
        assert rec["router"][0][0].shape[-1] == adapter.hidden_size == model.config.get_text_config().hidden_size
        declared = getattr(mod, "intermediate_dim", None) or getattr(mod, "intermediate_size", None)
        if declared is not None:
            assert layout.intermediate_size == declared
    assert adapter.bytes_per_expert() * adapter.num_experts * adapter.num_moe_layers == adapter.expert_bytes_total()
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert adapter.dense_bytes() + adapter.expert_bytes_total() == sum(unique.values())


# KV-cache bytes per token: a formula from the config; these families' caches hold something else.
KV_ESTIMATE_ONLY = {
    "deepseek_v4": "compressed / indexed attention caches",
    "inkling_text": "hybrid sliding layers with short-convolution state", "inkling2_text": "same",
    "inkling2_loop_text": "same", "mimo_v2_flash": "separate value head size and per-type heads",
    "zaya": "'hybrid' layer types",
}


def test_kv_bytes_per_token_matches_the_cache(built):
    family, model, adapter, _ = built
    if family in TOWERS:
        pytest.skip("text towers are not offloaded for generation")
    with torch.no_grad():
        out = model(input_ids=torch.arange(3, 8)[None], use_cache=True)
    stored = sum(t.numel() * t.element_size() for layer in out.cache.layers
                 for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))
    assert (adapter.kv_bytes_per_token() * 5 == stored) == (family not in KV_ESTIMATE_ONLY), (family, stored)


# --- (b) routing ---------------------------------------------------------------------------------
def test_routing_is_the_routers_own_bit_for_bit(built):
    family, _, adapter, records = built
    for m, rec in enumerate(records):
        args, kwargs, (hf_scores, hf_weights, hf_indices) = rec["router"]
        scores, weights, indices = adapter.route(m, args[0], **_state_inputs(adapter, m, args, kwargs))
        assert torch.equal(indices, hf_indices.reshape(indices.shape)), f"{family} layer {m}: indices differ"
        assert weights.dtype == hf_weights.dtype and torch.equal(weights, hf_weights.reshape(weights.shape))
        assert torch.equal(scores, hf_scores.reshape(scores.shape).float())


def test_routing_reaches_the_experts_call_unchanged(built):
    """The block hands the router's weights and indices to the experts as they are: what the adapter's
    routing returns is what an offloaded experts call receives. One exception, LongCat-Flash (transformers 5.25):
    a route to a zero (identity) expert, id >= E, reaches the experts as a weight-0 route to a routed expert."""
    _, _, adapter, records = built
    for rec in records:
        _, _, (_, weights, indices) = rec["router"]
        (_, idx, w), _ = rec["experts"]
        indices, weights = indices.reshape(idx.shape), weights.reshape(w.shape)
        routed = indices < adapter.num_experts
        assert torch.equal(idx[routed], indices[routed]) and torch.equal(w[routed], weights[routed])
        assert bool((w[~routed] == 0).all() and (idx[~routed] < adapter.num_experts).all())


def test_host_router_is_an_exact_copy(built):
    family, _, adapter, _ = built
    x = torch.randn(17, adapter.hidden_size, generator=torch.Generator().manual_seed(2))  # (T, H)
    for m in range(adapter.num_moe_layers):
        if set(adapter.router_site(m).missing) - set(adapter.router_site(m).optional):
            continue  # needs model inputs (DeepSeek-V4's hash layers): covered by the refusal test
        host = adapter.host_router(m)
        inputs = {n: None for n in adapter.router_site(m).optional}
        s, w, i = adapter.route(m, x, **inputs)
        r = host(x, **inputs)
        assert torch.equal(r.scores, s) and torch.equal(r.weights, w) and torch.equal(r.indices, i), family
        assert host.probs(x, **inputs).shape == (17, adapter.num_experts)


def test_probabilities_rank_what_the_router_chooses(built):
    """Fate's prediction reads `probs`/`choice_scores` of layer m+1: their ranking must be the router's own
    choice (for routers without expert groups, whose choice is a plain top-k)."""
    family, _, adapter, records = built
    for m, rec in enumerate(records):
        site = adapter.router_site(m)
        spec = adapter.fit(m).spec if not set(site.missing) - set(site.optional) else None
        if spec is None or spec.n_group is not None or spec.num_experts != adapter.num_experts:
            continue
        args, kwargs, (_, _, hf_indices) = rec["router"]
        choice = adapter.choice_scores(m, args[0], **_state_inputs(adapter, m, args, kwargs))  # (T, E)
        top = choice.topk(adapter.top_k, dim=-1).indices.sort(-1).values
        assert torch.equal(top, hf_indices.reshape(top.shape).sort(-1).values), family
        probs = adapter.probs(m, args[0], **_state_inputs(adapter, m, args, kwargs))
        assert probs.shape == choice.shape and bool((probs >= 0).all())


def test_select_experts_models_the_router_where_it_claims_to(built):
    family, _, adapter, records = built
    m = next((m for m in range(adapter.num_moe_layers)
              if set(adapter.router_site(m).missing) <= set(adapter.router_site(m).optional)), None)
    if m is None:
        pytest.skip(f"{family}: every router needs model inputs")
    fit = adapter.fit(m)
    assert fit.spec.exact == (family not in NOT_SELECT_EXPERTS), f"{family}: {fit.spec}"
    if fit.spec.exact:
        _, _, (hf_scores, hf_weights, hf_indices) = records[m]["router"]
        w, i = select_experts(fit.spec, hf_scores.reshape(-1, hf_scores.shape[-1]), fit.correction_bias)
        assert torch.equal(i, hf_indices.reshape(i.shape))
        torch.testing.assert_close(w, hf_weights.reshape(w.shape).float(), rtol=1e-5, atol=1e-6)


# --- (c) expert math -----------------------------------------------------------------------------
def _dispatched(model, mod, implementation: str, hidden, idx, w) -> torch.Tensor:
    """The experts module's own forward (T, H) with its experts computed by `implementation` (what the runtime
    replaces); a class that wraps the dispatched call in a forward of its own (Ergo) keeps that part."""
    model.set_experts_implementation(implementation)
    try:
        with torch.no_grad():
            return mod(hidden, idx, w)
    finally:
        model.set_experts_implementation("eager")


def _per_token(self, hidden, idx, w):
    """An experts implementation summed token by token: sum_k w_k * expert_apply(x, expert k)."""
    out = torch.zeros_like(hidden)  # (T, H)
    for t in range(hidden.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if 0 <= e < self.num_experts:
                out[t] += w[t, j] * expert_apply(self, hidden[t:t + 1], read_expert(self, e))[0]
    return out


def test_expert_math_equals_the_eager_experts_call(built):
    """Bit for bit: combine_experts sums w_k * expert_apply in the eager forward's order and dtype (reached, as the
    runtime is, through the module's own forward and the experts interface)."""
    family, model, adapter, records = built
    for m, rec in enumerate(records):
        (hidden, idx, w), hf_out = rec["experts"]
        mod = adapter.experts_module(m)
        out = _dispatched(model, mod, ex.reference_implementation(), hidden, idx, w)
        assert torch.equal(out, hf_out), f"{family} layer {m}: max diff {(out - hf_out).abs().max()}"
        if hasattr(type(mod).forward, "__wrapped__"):  # the decorated forward is the module's own: no wrapper
            assert torch.equal(combine_experts(mod, hidden, idx, w), hf_out)


def test_weighted_sum_matches_the_default_kernel(built):
    """Per token, sum_k w_k * expert_apply(x, expert k) equals the experts module under transformers'
    default kernel (grouped_mm on this machine), within fp32 reordering tolerance (rtol 1e-5)."""
    from transformers.integrations.moe import ExpertsInterface

    family, model, adapter, records = built
    ExpertsInterface.register("test_per_token", _per_token)
    for m, rec in enumerate(records):
        (hidden, idx, w), _ = rec["experts"]
        mod = adapter.experts_module(m)
        ref = _dispatched(model, mod, "grouped_mm", hidden, idx, w)  # (T, H)
        out = _dispatched(model, mod, "test_per_token", hidden, idx, w)  # (T, H)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()) + 1e-7, msg=family)


@pytest.mark.parametrize("family", FAMILIES + TOWERS)
def test_expert_math_equals_the_eager_experts_call_bf16(family):
    model = tiny_model(family, seed=3, dtype=torch.bfloat16)
    adapter = adapt(model)
    ids = torch.randint(3, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4))
    for m, rec in enumerate(_capture(model, adapter, ids)):
        (hidden, idx, w), hf_out = rec["experts"]
        assert hf_out.dtype == torch.bfloat16
        out = _dispatched(model, adapter.experts_module(m), ex.reference_implementation(), hidden, idx, w)
        assert torch.equal(out, hf_out), f"{family} layer {m}"
        assert ex.math_refusal(adapter.experts_module(m), family) is None  # the offload-time probe agrees
        args, kwargs, (_, hf_weights, hf_indices) = rec["router"]
        _, weights, indices = adapter.route(m, args[0], **_state_inputs(adapter, m, args, kwargs))
        assert torch.equal(indices, hf_indices.reshape(indices.shape))
        assert torch.equal(weights, hf_weights.reshape(weights.shape))


def test_post_expert_norm_layout_matches_transformers_batched_mm():
    """A layout no built family declares (muse_spark's post-expert norm): against transformers' own
    batched_mm kernel, which implements every declared flag generically."""
    from transformers.integrations.moe import batched_mm_experts_forward

    mod = adapt(tiny_model("mixtral", seed=8)).experts_module(0)
    mod.post_expert_norm = torch.nn.RMSNorm(mod.down_proj.shape[1], eps=1e-6)
    with torch.no_grad():
        mod.post_expert_norm.weight.normal_(1.0, 0.3)
    mod.has_post_expert_norm = True
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(11, mod.down_proj.shape[1], generator=g)  # (T, H)
    idx = torch.stack([torch.randperm(mod.num_experts, generator=g)[:2] for _ in range(11)])  # (T, 2)
    w = torch.rand(11, 2, generator=g)  # (T, 2)
    with torch.no_grad():
        ref = batched_mm_experts_forward(mod, hidden, idx, w)
        plain = combine_experts(mod, hidden, idx, w)
        mod.has_post_expert_norm = False
        without = combine_experts(mod, hidden, idx, w)
    torch.testing.assert_close(plain, ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(without, ref, atol=1e-3)  # the norm matters here


def test_expert_facts_are_read_off_the_installed_eager_source():
    """The accumulation/compute dtypes come from each eager forward's own source in the installed transformers, so
    a release that changes them (Nemotron-H's accumulation did in 5.25) is followed, not remembered."""
    seen = {}
    for module in experts_interface_modules():
        modeling = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=["_"])
        for name, cls in vars(modeling).items():
            if not (isinstance(cls, type) and hasattr(cls, "_apply_gate")
                    and hasattr(cls.__dict__.get("forward"), "__wrapped__")):  # what @use_experts_implementation made
                continue
            src = inspect.getsource(cls.forward.__wrapped__)
            first = next(line for line in src.splitlines() if "zeros_like" in line)
            accumulate, compute_fp32, used = ex.eager_facts(cls)
            assert ("torch.float32" in first) == (accumulate == "float32"), name
            assert ("top_k_weights.dtype" in first) == (accumulate == "weights"), name
            assert (".float() @" in src) == compute_fp32 and "down_proj" in used, name
            seen[name] = accumulate
    assert len(seen) >= 60
    assert seen["Inkling2Experts"] == seen["OpenAIPrivacyFilterExperts"] == "float32"
    assert seen["MixtralExperts"] == "output"


def test_a_release_that_computes_experts_differently_is_refused_with_the_reason(monkeypatch):
    """The offload-time probe compares fate_lab's math with the installed eager kernel bit for bit: when they part
    (here: fate_lab made to sum a bf16 model in float32, as if a release had changed the eager sum), offload refuses,
    naming the family, the class, the release and what to do, and takes nothing."""
    import transformers

    from fate_lab.core.config import OffloadConfig
    from fate_lab.offloading.runtime import offload

    model = tiny_model("mixtral", seed=0, dtype=torch.bfloat16)
    assert expert_refusal(adapt(model).experts_module(0), "mixtral") is None
    real = ex.eager_facts
    monkeypatch.setattr(ex, "eager_facts", lambda cls: ("float32", *real(cls)[1:]))
    with pytest.raises(NotImplementedError) as err:
        offload(model, OffloadConfig.preset("lru", link="instant", slots=2))
    for part in ("mixtral", "MixtralExperts", transformers.__version__, "max |difference|", "constraints.txt"):
        assert part in str(err.value)
    assert model.config._experts_implementation != "fate_offload"


@pytest.mark.parametrize("family", ["gpt_oss", "muse_spark_text", "nemotron_h"])
def test_the_probe_on_copies_of_two_experts_agrees_and_still_sees_a_difference(family, monkeypatch):
    """What a module on an accelerator, or one whose experts stay in the files, is probed with: a CPU stand-in
    holding copies of its first two experts (transposed and biased layouts, a post-expert norm submodule, an
    accumulation in another dtype). It passes where the module does, and still sees a changed sum."""
    monkeypatch.setattr(ex, "_VERDICTS", {})
    mod = adapt(tiny_model(family, seed=1, dtype=torch.bfloat16)).experts_module(0)
    two = [read_expert(mod, e).contiguous() for e in range(2)]
    assert ex.math_refusal(mod, family, two) is None
    real = ex.eager_facts
    wrong = {"output": "float32", "float32": "output", "weights": "output"}
    monkeypatch.setattr(ex, "eager_facts", lambda cls: (wrong[real(cls)[0]], *real(cls)[1:]))
    assert "max |difference|" in ex.math_refusal(mod, family, two)


def test_a_subclass_forward_around_the_dispatched_experts_is_served_exactly(tiny_models):
    """Ergo's layout (transformers 5.25), built here on any release: the experts class wraps the dispatched call in
    a forward of its own -- one row per route, a per-expert norm (a submodule the dispatched kernel never sees),
    then the weighted sum. The runtime replaces only the dispatched kernel, so tokens stay the plain model's."""
    from helpers import greedy, prompt_ids

    from fate_lab.core.config import OffloadConfig
    from fate_lab.offloading.runtime import offload

    model = tiny_models("mixtral", seed=4)
    base = type(adapt(model).experts_module(0))

    class PerRouteNorm(torch.nn.Module):
        def __init__(self, experts: int, hidden: int):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(experts, hidden) + 0.5)

        def forward(self, x, ids):
            return torch.nn.functional.rms_norm(x, (x.shape[-1],)) * self.weight[ids]

    class Wrapped(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            k = top_k_index.shape[1]
            flat = top_k_index.reshape(-1, 1)  # (T*k, 1): one route per row
            out = super().forward(hidden_states.repeat_interleave(k, dim=0), flat, hidden_states.new_ones(flat.shape))
            out = self.post_expert_norm(out, flat.flatten()).view(*top_k_index.shape, -1)  # (T, k, H)
            return (out * top_k_weights.unsqueeze(-1)).sum(1)

    for m in range(adapt(model).num_moe_layers):
        mod = adapt(model).experts_module(m)
        mod.__class__ = Wrapped
        mod.post_expert_norm = PerRouteNorm(mod.num_experts, mod.down_proj.shape[1])
    assert adapt(model).refusal() is None
    ids = prompt_ids(model.config.vocab_size)
    ref_tokens, ref_logits = greedy(model, ids, 6)
    with offload(model, OffloadConfig.preset("fate", link="instant", slots=3)):
        tokens, logits = greedy(model, ids, 6)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_a_submodule_the_dispatched_kernel_uses_is_refused_by_name():
    """A decorated experts forward that calls a submodule fate_lab does not compute is refused, naming it."""
    from transformers.integrations.moe import use_experts_implementation

    model = tiny_model("mixtral")
    mod = adapt(model).experts_module(0)
    base = type(mod)

    @use_experts_implementation
    class Scaled(base):
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return self.scale(ex.eager_forward(base)(self, hidden_states, top_k_index, top_k_weights))

    mod.__class__ = Scaled
    mod.scale = torch.nn.Linear(mod.down_proj.shape[1], mod.down_proj.shape[1])
    reason = expert_refusal(mod, "mixtral")
    assert "Scaled" in reason and "['scale']" in reason and "does not compute" in reason


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4_text", "zaya"])
def test_trace_records_any_router(family):
    """record_trace hooks the adapter's router (named `router` in gpt-oss, in the decoder layer in Gemma 4,
    an MLP in ZAYA); its routing equals what the experts calls received."""
    from fate_lab.model.record import record_trace
    from fate_lab.model.trace import cross_layer_scores

    model = tiny_model(family, seed=2)
    adapter = adapt(model)
    trace = record_trace(model, None, [[5, 6, 7, 8]], decode_tokens=2, progress=False)
    assert trace.experts.shape == (6, adapter.num_moe_layers, adapter.top_k)
    assert trace.gate_inputs.shape == (6, adapter.num_moe_layers, adapter.hidden_size)
    _, _, idx = adapter.route(0, trace.gate_inputs[:4, 0], **{n: None for n in adapter.router_site(0).optional})
    assert torch.equal(idx, trace.experts[:4, 0])
    if not adapter.router_spec.linear:
        with pytest.raises(ValueError, match="probs"):
            cross_layer_scores(trace)


# --- (d) checkpoints ------------------------------------------------------------------------------
def test_checkpoint_reads_one_expert_as_the_module_holds_it(built, tmp_path):
    """save_pretrained writes each family's on-disk layout (per-expert keys where transformers has a rule to
    fuse them on load, fused tensors otherwise); reading one expert gives the module's tensors exactly."""
    family, model, adapter, _ = built
    model.save_pretrained(tmp_path)
    index = ExpertIndex.build(model, tmp_path)
    assert index.refusal() is None, index.refusal()
    for m in range(adapter.num_moe_layers):
        for e in (0, adapter.num_experts - 1):
            assert index.read(m, e).equal(read_expert(adapter.experts_module(m), e).to()), f"{family} ({m}, {e})"


def _write_mixtral_by_hand(model, folder) -> None:
    """Mixtral's original per-expert layout (block_sparse_moe.experts.{j}.w1/w2/w3), written without HF's saver."""
    tensors = {}
    for k, v in model.state_dict().items():
        if ".experts." not in k:
            tensors[k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = v.contiguous()
    for i, layer in enumerate(model.model.layers):
        exp, inter = layer.mlp.experts, layer.mlp.experts.down_proj.shape[-1]
        for j in range(exp.num_experts):
            pre = f"model.layers.{i}.block_sparse_moe.experts.{j}"
            tensors[f"{pre}.w1.weight"] = exp.gate_up_proj[j, :inter].contiguous()
            tensors[f"{pre}.w3.weight"] = exp.gate_up_proj[j, inter:].contiguous()
            tensors[f"{pre}.w2.weight"] = exp.down_proj[j].contiguous()
    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})


def _write_fused_by_hand(model, folder) -> None:
    """The model's own fused tensors (mlp.experts.gate_up_proj [E, 2I, H]) under their module names."""
    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    seen, tensors = set(), {}
    for k, v in model.state_dict().items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            tensors[k] = v.contiguous()
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("family,writer", [("mixtral", _write_mixtral_by_hand), ("qwen2_moe", _write_fused_by_hand),
                                           ("deepseek_v3", _write_fused_by_hand), ("gpt_oss", _write_fused_by_hand)])
def test_hand_written_layouts_read_and_load_like_from_pretrained(family, writer, tmp_path):
    model = tiny_model(family, seed=5)
    writer(model, tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # transformers' own reading of the same files
    adapter, ref_adapter = adapt(model), adapt(ref)
    index = ExpertIndex.build(model, tmp_path)
    for m in range(adapter.num_moe_layers):
        for e in range(adapter.num_experts):
            w = index.read(m, e)
            assert w.equal(read_expert(ref_adapter.experts_module(m), e).to()) and w.equal(adapter.expert(m, e).to())


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "gpt_oss", "nemotron_h", "deepseek_v3", "granitemoe",
                                    "lara_mini"])
def test_load_without_experts_then_serve_them_from_disk(family, tmp_path):
    """Dense tensors equal from_pretrained's, experts stay meta (no bytes); filled from the index one expert
    at a time, the model's logits equal the original's."""
    model = tiny_model(family, seed=6)
    model.save_pretrained(tmp_path)
    lean, index, report = load_without_experts(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ref_params, ref_buffers = dict(ref.named_parameters()), dict(ref.named_buffers())
    experts = set(report.experts_on_meta)
    assert experts and all(p.is_meta for n, p in lean.named_parameters() if n in experts)
    for n, p in lean.named_parameters():
        assert n in experts or torch.equal(p, ref_params[n]), n
    for n, b in lean.named_buffers():
        assert torch.equal(b, ref_buffers[n]), n
    adapter = adapt(lean)
    for m in range(adapter.num_moe_layers):
        mod, layout = adapter.experts_module(m), adapter.layouts[m]
        ws = [index.read(m, e) for e in range(adapter.num_experts)]
        up = torch.stack([w.gate_up.T if layout.is_transposed else w.gate_up for w in ws])
        down = torch.stack([w.down.T if layout.is_transposed else w.down for w in ws])
        setattr(mod, layout.up_name, torch.nn.Parameter(up, requires_grad=False))
        mod.down_proj = torch.nn.Parameter(down, requires_grad=False)
        if layout.has_bias:
            setattr(mod, f"{layout.up_name}_bias", torch.nn.Parameter(torch.stack([w.gate_up_bias for w in ws])))
            mod.down_proj_bias = torch.nn.Parameter(torch.stack([w.down_bias for w in ws]))
    ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(lean(input_ids=ids).logits, ref(input_ids=ids).logits)


# --- (e) refusals ---------------------------------------------------------------------------------
def test_quantized_or_unknown_expert_tensors_are_refused_by_name():
    model = tiny_model("mixtral")
    mod = adapt(model).experts_module(0)
    assert expert_refusal(mod, "mixtral") is None
    mod.register_buffer("gate_up_proj_scale", torch.ones(mod.num_experts))
    reason = expert_refusal(mod, "mixtral")
    assert all(s in reason for s in ("mixtral", "MixtralExperts", "gate_up_proj_scale", "dequantiz"))
    del mod.gate_up_proj_scale
    mod.gate_up_proj = torch.nn.Parameter(torch.zeros(mod.gate_up_proj.shape, dtype=torch.int8), requires_grad=False)
    reason = expert_refusal(mod, "mixtral")
    assert "torch.int8" in reason and "gate_up_proj" in reason and "load the checkpoint dequantized" in reason
    with pytest.raises(NotImplementedError, match="int8"):
        ex.check_servable(mod, "mixtral")


def test_quantized_checkpoint_is_refused_by_name(tmp_path):
    model = tiny_model("qwen2_moe")
    _write_fused_by_hand(model, tmp_path)
    from safetensors import safe_open

    with safe_open(f"{tmp_path}/model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    tensors["model.layers.0.mlp.experts.gate_up_proj_scale_inv"] = torch.ones(8, 1)
    save_file(tensors, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    index = ExpertIndex.build(model, tmp_path)
    assert "gate_up_proj_scale_inv" in index.refusal() and "float dtype" in index.refusal()
    with pytest.raises(NotImplementedError, match="gate_up_proj_scale_inv"):
        index.read(0, 0)


@pytest.mark.parametrize("family,needs", [("deepseek_v4", "input_ids"), ("zaya", "router_states")])
def test_router_that_needs_model_inputs_says_which(family, needs):
    adapter = adapt(tiny_model(family))
    m = next(m for m in range(adapter.num_moe_layers) if needs in adapter.router_site(m).missing)
    with pytest.raises(MissingRouterInput, match=needs):
        adapter.route(m, torch.zeros(3, adapter.hidden_size))


def test_non_moe_model_refused_naming_the_interface():
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="experts interface"):
        adapt(model)


# --- the family table ----------------------------------------------------------------------------
def test_every_experts_interface_module_is_classified():
    """Each module of the installed transformers using the experts interface: a causal-LM family that builds
    and generates here, a text tower that builds (forward only), or neither, said by name."""
    modules = experts_interface_modules()
    assert len(modules) >= 60
    assert {f for types in modules.values() for f in types if f in FAMILIES} == set(FAMILIES)
    towers = text_tower_types()
    for module, types in modules.items():
        status = family_status(module, types)
        if status.family in FAMILIES:
            assert status.builds and status.generates, status
        elif status.family in TOWERS:
            assert status.builds and not status.generates and "text tower" in status.reason, status
        else:
            assert not status.builds and status.reason, status
            assert status.family == towers.get(module)
