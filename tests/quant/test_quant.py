"""quant.py: round trips against a brute-force reference, exact packing and byte counts, policy, quality."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import embedded_models

from fate_lab.model.adapters import adapt
from fate_lab.model.testing import tiny_model
from fate_lab.quant import (
    QuantPolicy,
    QuantSpec,
    expert_nbytes,
    pack,
    packed_nbytes,
    quality_report,
    quantize,
    quantize_expert,
    quantize_model_experts,
    quantized_nbytes,
    unpack,
)

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None

SPECS = [QuantSpec(8, 64), QuantSpec(4, 64), QuantSpec(3, 64), QuantSpec(2, 32), QuantSpec(4, 32), QuantSpec(3, 16)]


def _reference(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute-force per-group min-max: (dequantized w, per-element scale), written as plainly as possible."""
    qmax = 2**bits - 1
    flat = w.reshape(-1).tolist()
    out, scales = [], []
    for start in range(0, len(flat), group):
        chunk = flat[start:start + group]
        lo, hi = min(chunk), max(chunk)
        scale = (hi - lo) / qmax
        for x in chunk:
            code = 0 if scale == 0 else min(max(round((x - lo) / scale), 0), qmax)
            out.append(code * scale + lo)
            scales.append(scale)
    return torch.tensor(out).view(w.shape), torch.tensor(scales).view(w.shape)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_round_trip_within_half_a_step_of_reference(spec):
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(spec.bits)) * 0.05
    ref, ref_scale = _reference(w, spec.bits, spec.group_size)
    q = quantize(w, spec)
    got = q.dequantize()
    # the stored fp16 scale is rounded up, never by more than one fp16 ulp (2^-10 relative)
    bound = ref_scale * (1 + 2**-9) / 2 + 1e-7
    assert ((got - w).abs() <= bound).all()
    assert ((ref - w).abs() <= ref_scale / 2 + 1e-7).all()  # the reference itself obeys the bound
    stored = q.scale.float().repeat_interleave(spec.group_size, dim=-1)  # (24, 128)
    assert ((got - w).abs() <= stored / 2 + 1e-7).all()  # the bound also holds with the stored scale
    # and the result is the reference up to a code step at rounding ties
    assert (got - ref).abs().max() <= ref_scale.max() * 1.01
    assert (got - w).abs().mean() == pytest.approx((ref - w).abs().mean().item(), rel=0.02)


def test_codes_and_grid_exact_on_a_hand_example():
    # one group of 4 at 2 bits: min 0, max 3 -> scale 1, codes are the values themselves
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0, -1.0, -1.0, 0.5]])
    q = quantize(w, QuantSpec(2, 4))
    assert q.codes().tolist() == [[0, 1, 2, 3, 0, 0, 0, 3]]
    assert q.scale.tolist() == [[1.0, 0.5]] and q.zero.tolist() == [[0.0, -1.0]]
    assert q.dequantize().tolist() == [[0.0, 1.0, 2.0, 3.0, -1.0, -1.0, -1.0, 0.5]]
    assert q.packed.tolist() == [0b11100100, 0b11000000]  # code i at bits 2i..2i+1


def test_constant_group_is_exact():
    w = torch.full((2, 64), 0.25)
    assert torch.equal(quantize(w, QuantSpec(4, 64)).dequantize(), w)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 64, 1000])
def test_pack_unpack_round_trip(bits, numel):
    codes = torch.randint(0, 2**bits, (numel,), generator=torch.Generator().manual_seed(numel), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == (numel if bits == 8 else math.ceil(numel / 8) * bits)
    assert torch.equal(unpack(packed, bits, numel), codes)


if given is not None:
    @settings(max_examples=60, deadline=None)
    @given(bits=st.sampled_from([2, 3, 4, 8]), data=st.data())
    def test_pack_unpack_round_trip_hypothesis(bits, data):
        values = data.draw(st.lists(st.integers(0, 2**bits - 1), min_size=1, max_size=200))
        codes = torch.tensor(values, dtype=torch.uint8)
        assert unpack(pack(codes, bits), bits, len(values)).tolist() == values


def test_pack_layouts_by_hand():
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], dtype=torch.uint8)
    assert pack(codes, 4).tolist() == [0x21, 0x43, 0x65, 0x07]  # low nibble first
    # 3-bit: 24-bit little-endian word 0b000_111_110_101_100_011_010_001
    word = sum(c << (3 * i) for i, c in enumerate(codes.tolist()))
    assert pack(codes, 3).tolist() == [word & 0xFF, (word >> 8) & 0xFF, word >> 16]
    assert pack(codes, 8).tolist() == codes.tolist()


def test_packed_sizes_exact():
    # expert matrix [128, 256]: 32768 weights
    assert quantized_nbytes((128, 256), QuantSpec(4, 64)) == 16384 + 2 * 2 * 512  # 2/byte + fp16 s,z per group
    assert quantized_nbytes((128, 256), QuantSpec(2, 32)) == 8192 + 2 * 2 * 1024
    assert quantized_nbytes((128, 256), QuantSpec(3, 64)) == 12288 + 2 * 2 * 512
    assert quantized_nbytes((128, 256), QuantSpec(8, 64)) == 32768 + 2 * 2 * 512
    assert packed_nbytes(10, 3) == 6  # 10 codes -> 2 units of 8 -> 6 bytes
    # an expert of the embedded model (H 256, I 128): gate, up [128, 256] and down [256, 128]
    shapes = {"gate": (128, 256), "up": (128, 256), "down": (256, 128)}
    assert expert_nbytes(shapes, QuantSpec.preset("int4")) == 3 * (16384 + 2048)
    assert expert_nbytes(shapes, None) == 3 * 32768 * 2  # unquantized fp16


@pytest.mark.parametrize("spec", SPECS + [QuantSpec(4, 64, refine=True)], ids=str)
def test_quantized_nbytes_matches_tensor(spec):
    w = torch.randn(3, 16, 128)
    q = quantize(w, spec)
    assert q.nbytes() == quantized_nbytes(w.shape, spec)
    assert q.scale.dtype == q.zero.dtype == torch.float16 and q.scale.shape == (3, 16, 128 // spec.group_size)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="bits=5"):
        QuantSpec(5, 64)
    with pytest.raises(ValueError, match="group_size"):
        QuantSpec(4, 0)
    with pytest.raises(ValueError, match="does not divide"):
        quantize(torch.randn(4, 96), QuantSpec(4, 64))
    with pytest.raises(ValueError, match="does not divide"):
        quantized_nbytes((4, 96), QuantSpec(4, 64))
    with pytest.raises(ValueError, match="bits=5"):
        pack(torch.zeros(8, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="codes must lie"):
        pack(torch.tensor([0, 4]), 2)
    with pytest.raises(ValueError, match="packed bytes"):
        unpack(torch.zeros(5, dtype=torch.uint8), 4, 16)
    with pytest.raises(ValueError, match="preset"):
        QuantSpec.preset("int5")


def test_refine_lowers_mean_error():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    for name in ("int4", "int2"):
        plain = (quantize(w, QuantSpec.preset(name)).dequantize() - w).abs().mean()
        refined = (quantize(w, QuantSpec.preset(name + "_hqq")).dequantize() - w).abs().mean()
        assert refined < plain


@pytest.mark.parametrize("refine", [False, True])
def test_expert_view_equals_slice_of_fused_tensor(refine):
    model = tiny_model("qwen2_moe")
    ad = adapt(model)
    spec = QuantSpec(4, 32, refine=refine)
    fused = quantize(ad.experts_module(0).gate_up_proj.data, spec).dequantize()  # (E, 2I, H)
    one = quantize_expert(ad.expert_weights(0, 3), spec)
    inter = ad.expert_intermediate_size
    assert torch.equal(one["gate"].dequantize(), fused[3, :inter])
    assert torch.equal(one["up"].dequantize(), fused[3, inter:])
    assert one["down"].shape == tuple(ad.expert_weights(0, 3)["down"].shape)


def test_to_moves_packed_bytes():
    q = quantize(torch.randn(8, 64), QuantSpec(4, 64))
    moved = q.to("cpu", non_blocking=True)
    assert torch.equal(moved.dequantize(), q.dequantize()) and moved.nbytes() == q.nbytes()


def test_policy_presets_and_overrides():
    fate = QuantPolicy.preset("fate")
    int4, int2 = QuantSpec(4, 64), QuantSpec(2, 32)
    assert [fate.precision_for(5, r) for r in ("cache", "prefetch", "prefill_low", "miss")] == [int4, int4, int2, int2]
    assert fate.host_specs(5) == (int4, int2)
    assert fate.prefill_low_count(9) == 4
    assert QuantPolicy.preset("fp16").precision_for(0, "miss") is None
    assert QuantPolicy.preset("int8").precision_for(2, "prefill_low") == QuantSpec(8, 64)
    shallow = fate.with_shallow(2, QuantSpec(8, 64))
    assert shallow.precision_for(1, "miss") == QuantSpec(8, 64) and shallow.precision_for(2, "miss") == int2
    assert fate.with_shallow(1, None).precision_for(0, "cache") is None
    with pytest.raises(ValueError, match="reason"):
        fate.precision_for(0, "evict")
    with pytest.raises(ValueError, match="prefill_low_share"):
        QuantPolicy(prefill_low_share=1.5)


def test_int8_model_keeps_greedy_tokens():
    model = tiny_model("qwen2_moe", seed=1)
    int8 = QuantSpec(8, 32)  # the tiny model's experts are 32 wide
    q_model = quantize_model_experts(model, QuantPolicy(cache=int8, prefetch=int8, miss=int8))
    assert not torch.equal(q_model.model.layers[0].mlp.experts.down_proj, model.model.layers[0].mlp.experts.down_proj)
    prompts = torch.randint(3, 128, (4, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref, got = model.generate(prompts, **kw), q_model.generate(prompts, **kw)
    agreement = (ref == got).float().mean().item()
    assert agreement == 1.0, f"int8 greedy agreement {agreement:.3f}"


def test_quality_report_orders_precisions():
    model = tiny_model("mixtral", seed=2)
    batches = [torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    same = quality_report(model, model, batches)
    assert same["perplexity_fp"] == same["perplexity_q"] and same["greedy_agreement"] == 1.0
    assert abs(same["mean_kl"]) < 1e-6 and same["n_tokens"] == 2 * 2 * 23
    r8 = quality_report(model, quantize_model_experts(model, QuantSpec(8, 8)), batches)
    r2 = quality_report(model, quantize_model_experts(model, QuantSpec(2, 8)), batches)
    assert 0 <= r8["mean_kl"] < r2["mean_kl"]
    assert r8["greedy_agreement"] >= r2["greedy_agreement"]


def test_quality_report_perplexity_change_uncertainty_against_per_position_nll():
    import statistics

    model = tiny_model("mixtral", seed=2)
    q_model = quantize_model_experts(model, QuantSpec(2, 8))
    batches = [torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    r = quality_report(model, q_model, batches, progress=False)
    d = []  # per-position NLL differences, from cross_entropy (an independent path)
    with torch.no_grad():
        for ids in batches:
            nll = [torch.nn.functional.cross_entropy(m(input_ids=ids).logits[:, :-1].double().flatten(0, 1),
                                                     ids[:, 1:].flatten(), reduction="none") for m in (model, q_model)]
            d += (nll[1] - nll[0]).tolist()
    mean = statistics.fmean(d)
    assert r["perplexity_q"] / r["perplexity_fp"] - 1 == pytest.approx(math.exp(mean) - 1, rel=1e-6)
    assert r["ppl_change_uncertainty"] == pytest.approx(math.exp(mean) * 2 * statistics.stdev(d) / math.sqrt(len(d)),
                                                        rel=1e-6)
    assert quality_report(model, model, batches, progress=False)["ppl_change_uncertainty"] == 0.0


def test_quantize_model_experts_policy_and_overrides():
    model = tiny_model("qwen2_moe", seed=1)
    policy = QuantPolicy(cache=QuantSpec(4, 32), miss=QuantSpec(2, 32)).with_shallow(1, None)  # layer 0 stays full
    q_model = quantize_model_experts(model, policy, overrides={(1, 2): None})
    ad, qad = adapt(model), adapt(q_model)
    assert torch.equal(qad.experts_module(0).down_proj, ad.experts_module(0).down_proj)
    assert torch.equal(qad.experts_module(1).down_proj[2], ad.experts_module(1).down_proj[2])
    assert not torch.equal(qad.experts_module(1).down_proj[1], ad.experts_module(1).down_proj[1])
    # the original model is untouched
    fresh = adapt(tiny_model("qwen2_moe", seed=1))
    assert torch.equal(ad.experts_module(1).down_proj, fresh.experts_module(1).down_proj)


def test_offset_groups_stay_on_the_grid():
    # groups far from zero with a tiny range: the fp16 zero must not land above the group's values
    w = 100.035 + 0.01 * torch.rand(4, 64, generator=torch.Generator().manual_seed(5))
    for spec in (QuantSpec(8, 64), QuantSpec(2, 32)):
        q = quantize(w, spec)
        stored = q.scale.float().repeat_interleave(spec.group_size, dim=-1)  # (4, 64)
        assert ((q.dequantize() - w).abs() <= stored / 2 + 1e-6).all()
        # the grid starts at most one fp16 step (0.0625 at 100) below the min, so a step is < 0.0625/qmax
        assert (q.dequantize() - w).abs().max() < 0.0625 / (2**spec.bits - 1)


def test_fp16_outward_rounding_matches_nextafter():
    from fate_lab.quant.kernels import _round_fp16

    x = torch.cat([torch.randn(5000) * torch.logspace(-7, 4, 5000), torch.tensor([0.0, 1e-9, -1e-9])])
    for d in (math.inf, -math.inf):
        near = x.half()
        wrong_way = near.float() < x if d > 0 else near.float() > x
        ref = torch.where(wrong_way, torch.nextafter(near, torch.full_like(near, d)), near)
        got = _round_fp16(x, d)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
        assert ((got.float() >= x) if d > 0 else (got.float() <= x)).all()


@pytest.mark.parametrize("model_name", embedded_models())
def test_int8_embedded_model_keeps_greedy_tokens_on_test_prompts(model_name):
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.models import load_model

    model, tok = load_model(model_name)
    q_model = quantize_model_experts(model, QuantPolicy.preset("int8"))
    agree = total = 0
    for prompt in heldout_prompts(4, max_chars=200):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id or 0)
        with torch.no_grad():
            ref, got = model.generate(ids, **kw)[0, ids.shape[1]:], q_model.generate(ids, **kw)[0, ids.shape[1]:]
        agree += (ref == got).sum().item()
        total += ref.numel()
    assert agree == total, f"int8 greedy agreement on the embedded model {agree}/{total}"


def test_dequantize_into_a_slot_of_a_fused_buffer():
    w = torch.randn(3, 16, 64)
    q = quantize(w[1], QuantSpec(4, 64))
    buf = torch.zeros(3, 16, 64, dtype=torch.bfloat16)
    q.dequantize(out=buf[1])
    assert torch.equal(buf[1], q.dequantize(torch.bfloat16)) and not buf[0].any()
    with pytest.raises(ValueError, match="out has shape"):
        q.dequantize(out=buf)


# --- refused inputs: non-finite weights, weights beyond the fp16 scale/zero, malformed specs -----
def test_non_finite_weights_are_refused_with_name_and_count():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    w[1, 3], w[2, 0], w[3, 63] = float("nan"), float("inf"), -float("inf")  # 3 of 256, first in row order at (1, 3)
    for spec in (QuantSpec(4, 64), QuantSpec(2, 32, refine=True)):
        with pytest.raises(ValueError, match=r"'down'.*3 of 256 values are non-finite.*\(1, 3\)"):
            quantize(w, spec, name="down")
    ok = torch.zeros(4, 64)
    with pytest.raises(ValueError, match=r"tensor 'up' .*non-finite"):  # quantize_expert names the matrix
        quantize_expert({"gate": ok, "up": w, "down": ok}, QuantSpec(4, 64))


def test_quantize_model_experts_names_the_layer_with_a_nan():
    model = tiny_model("qwen2_moe", seed=1)
    down = adapt(model).experts_module(1).down_proj  # (E, H, I)
    with torch.no_grad():
        down[2, 0, 5] = float("nan")
    numel = down[2].numel()  # one expert's down projection: quantized expert by expert, on its canonical view
    with pytest.raises(ValueError, match=rf"MoE layer 1 expert 2 down.*1 of {numel} values.*\(0, 5\)"):
        quantize_model_experts(model, QuantSpec(4, 32))


@pytest.mark.parametrize("big", [70000.0, -70000.0, 1e6])
def test_weights_beyond_fp16_range_are_refused(big):
    # fp16's largest finite value is 65504. Before, a group with min < -65504 got an inf zero and one with
    # span / qmax > 65504 an inf scale, and dequantized to NaN (-70000 at 4/8 bits, 1e6 at 4 bits); a large
    # positive outlier in a small group happened to fit. The rule is now spec-independent: max |w| <= 65504.
    w = torch.randn(2, 64, generator=torch.Generator().manual_seed(1))
    w[1, 7] = big
    for spec in (QuantSpec(4, 64), QuantSpec(8, 64), QuantSpec(2, 32, refine=True)):
        pattern = rf"'w1'.*max \|w\| = {re.escape(f'{abs(big):g}')} exceeds the fp16 range \(65504\)"
        with pytest.raises(ValueError, match=pattern):
            quantize(w, spec, name="w1")


def test_weights_at_the_fp16_limit_still_quantize_exactly_as_by_hand():
    # one 2-bit group of +-65504: zero = -65504 (exact in fp16); scale = 131008 / 3 = 43669.33, rounded up to
    # the next fp16 value (spacing 32 in [32768, 65536)) = 1365 * 32 = 43680; codes 0 and 3 -> -65504, 65536
    w = torch.tensor([[-65504.0, 65504.0] * 16])
    q = quantize(w, QuantSpec(2, 32))
    assert q.scale.tolist() == [[43680.0]] and q.zero.tolist() == [[-65504.0]]
    assert q.codes().tolist() == [[0, 3] * 16]
    assert q.dequantize().tolist() == [[-65504.0, 65536.0] * 16]


@pytest.mark.parametrize("args, error, pattern", [
    ((4.0, 64), TypeError, r"bits must be an int, got 4\.0 \(float\).*\(2, 3, 4, 8\)"),
    ((True, 64), TypeError, r"bits must be an int, got True \(bool\)"),
    ((6, 64), ValueError, r"bits=6 is not supported; use one of \(2, 3, 4, 8\)"),
    ((4, 64.0), TypeError, r"group_size must be an int, got 64\.0 \(float\).*positive int"),
    ((4, "64"), TypeError, r"group_size must be an int, got '64' \(str\)"),
    ((4, 0), ValueError, r"group_size=0 is not allowed; group_size must be a positive int"),
    ((4, -32), ValueError, r"group_size=-32 is not allowed"),
    ((4, 64, 1), TypeError, r"refine must be True or False, got 1"),
])
def test_quant_spec_refuses_wrong_types_and_values(args, error, pattern):
    with pytest.raises(error, match=pattern):
        QuantSpec(*args)


def test_quant_spec_accepts_numpy_ints_as_plain_ints():
    np = pytest.importorskip("numpy")
    spec = QuantSpec(np.int64(4), np.int32(64))
    assert spec == QuantSpec(4, 64) and hash(spec) == hash(QuantSpec(4, 64)) and type(spec.group_size) is int


def test_pack_and_unpack_refuse_float_bits():
    with pytest.raises(TypeError, match=r"bits must be an int, got 4\.0"):
        pack(torch.zeros(8, dtype=torch.uint8), 4.0)
    with pytest.raises(TypeError, match=r"bits must be an int, got 2\.0"):
        unpack(torch.zeros(2, dtype=torch.uint8), 2.0, 8)
