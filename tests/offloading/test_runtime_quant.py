"""Quantized experts in the runtime: INT8 keeps the greedy output, the runtime's logits equal an
independent quantized copy of the model, packed bytes are what moves (and what the link holds
for) and what the device slots hold, and the planner fits more slots at INT4 within the budget."""
from __future__ import annotations

import pytest
import torch
from helpers import embedded_models, greedy, prompt_ids

from fate_lab.hardware.links import LinkProfile
from fate_lab.model.adapters import adapt
from fate_lab.model.testing import tiny_model
from fate_lab.offloading.runtime import OffloadConfig, offload
from fate_lab.offloading.slots import FullSlots
from fate_lab.offloading.store import QuantizedStore, RamStore
from fate_lab.offloading.transfer import EmulatedEngine
from fate_lab.quant import QuantPolicy, QuantSpec, quantize_model_experts

NEW_TOKENS = 10
# hidden 64, expert width 64 (group 64 must divide both), 16 experts, top-2, 2 MoE layers
SIZES = dict(moe_intermediate_size=64, num_experts=16)


def _model(seed: int = 1):
    return tiny_model("qwen2_moe", seed=seed, **SIZES)





def _generate(model, ids, n=NEW_TOKENS, **kw):
    return greedy(model, ids, n, **kw)


def _hand_nbytes(rows: int, cols: int, bits: int, group: int) -> int:
    """Packed codes (bits per weight) + one fp16 scale and one fp16 zero per group, by hand."""
    numel = rows * cols
    return numel * bits // 8 + (numel // group) * (2 + 2)


def _hand_expert_bytes(hidden: int, inter: int, bits: int, group: int) -> int:
    """gate_up [2I, H] + down [H, I]."""
    return _hand_nbytes(2 * inter, hidden, bits, group) + _hand_nbytes(hidden, inter, bits, group)


def test_quant_presets_are_listed_apart_and_bad_names_are_refused(tiny_models):
    assert "fate_quant" not in OffloadConfig.preset_names()  # the exact-output presets only
    assert {"fate_quant", "fate_int8"} <= set(OffloadConfig.preset_names(include_quant=True))
    assert OffloadConfig.preset("fate_quant").quant == "fate" and OffloadConfig.preset("fate").quant is None
    with pytest.raises(ValueError, match="QuantPolicy preset"):
        offload(_model(), OffloadConfig.preset("fate", quant="int5", link="test_fast"))
    with pytest.raises(ValueError, match="group size"):  # width 32 is not a multiple of group 64
        offload(tiny_models("qwen2_moe", seed=1), OffloadConfig.preset("fate_quant", link="test_fast"))


def test_int8_everywhere_keeps_the_greedy_output():
    model = _model()
    ids = prompt_ids(model.config.vocab_size)
    ref_tokens, ref_logits = _generate(model, ids)
    for slots in (8, 0):
        with offload(model, OffloadConfig.preset("fate_int8", link="test_fast", slots=slots)) as rt:
            tokens, logits = _generate(model, ids)
        assert torch.equal(tokens, ref_tokens), slots
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-2)  # close, not equal: 8-bit weights
        assert set(label for _, _, label in rt.stats.moved) == {"int8/g64"}
    tokens, _ = _generate(model, ids)  # close() restored the full-precision experts
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_runtime_logits_equal_an_independently_quantized_model(quant):
    model = _model(seed=2)
    ids = prompt_ids(model.config.vocab_size, seed=3)
    ref_tokens, ref_logits = _generate(quantize_model_experts(model, QuantSpec.preset(quant)), ids)
    for preset, budget in (("fate", dict(slots=8)), ("load_on_demand", {}), ("all_resident", {})):
        with offload(model, OffloadConfig.preset(preset, link="test_fast", quant=quant, **budget)) as rt:
            tokens, logits = _generate(model, ids)
            assert rt.stats.total("decode").bytes_moved > 0 or preset == "all_resident"
        assert torch.equal(tokens, ref_tokens), preset
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_fate_quant_moves_packed_bytes_at_the_policy_precisions():
    model = _model(seed=3)
    a = adapt(model)
    ids = prompt_ids(model.config.vocab_size, n=12, seed=5)
    per_spec = {"int4/g64": _hand_expert_bytes(64, 64, 4, 64), "int2/g32": _hand_expert_bytes(64, 64, 2, 32)}
    assert per_spec == {"int4/g64": 6912, "int2/g32": 4608}  # vs 49152 bytes at fp32
    seen: list = []
    with offload(model, OffloadConfig.preset("fate_quant", link="test_fast", slots=12)) as rt:
        rt.watch_transfers(seen.append)
        tokens, logits = _generate(model, ids)
    assert tokens.shape[1] == ids.shape[1] + NEW_TOKENS and torch.isfinite(logits.max(-1).values).all()
    assert rt.store.describe() == "ram + packed int4/g64, int2/g32"
    # every transfer carries its packed size; Fate's misses travel at INT2, prefetches at INT4
    assert seen and all(t.nbytes == per_spec[f"int{t.spec.bits}/g{t.spec.group_size}"] for t in seen)
    assert 2 in {t.spec.bits for t in seen if t.urgent} and 4 in {t.spec.bits for t in seen if not t.urgent}
    for i, t in enumerate(seen):  # an urgent INT4 transfer is a late prefetch moved up the queue, never a miss
        if t.urgent and t.spec.bits == 4:
            assert any(p.cancelled and not p.urgent and (p.m, p.e, p.slot) == (t.m, t.e, t.slot) for p in seen[:i])
    # stats count the same bytes: landed transfers per precision x packed size
    for phase in ("prefill", "decode"):
        for m in range(a.num_moe_layers):
            expected = sum(n * per_spec[label] for (p, mm, label), n in rt.stats.moved.items() if (p, mm) == (phase, m))
            assert rt.stats.layers[m][phase].bytes_moved == expected
    assert sum(rt.stats.moved.values()) > 0
    # a prefill's least popular predicted experts are prefetched at INT2 (the tail half under `fate`)
    assert QuantPolicy.preset("fate").prefill_low_count(8) == 4
    assert any(not t.urgent and t.spec.bits == 2 for t in seen)


def test_failed_quantized_transfer_reloads_at_its_precision():
    model = _model(seed=4)
    ids = prompt_ids(model.config.vocab_size, seed=1)
    ref_tokens, ref_logits = _generate(quantize_model_experts(model, QuantSpec.preset("int4")), ids)
    with offload(model, OffloadConfig.preset("fate", link="test_fast", slots=4, quant="int4")) as rt:
        rt.set_fault(lambda m, e: e % 2 == 0)
        tokens, logits = _generate(model, ids)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert sum(s["failures"] for s in rt.stats.summary().values()) > 0


def test_a_budget_holds_more_slots_at_int4():
    model = _model()
    a = adapt(model)
    fp, int4 = 3 * 64 * 64 * 4, 6912  # one expert: fp32 weights; INT4 g64 packed (4096+512 + 2048+256)
    need_fp = a.dense_bytes() + a.kv_bytes_per_token() * 512 + (2 + 2 * 2) * fp  # top-2 + 2 pools of 2 buffers
    budget = need_fp + 1 * fp  # one fp32 cache slot
    with offload(model, OffloadConfig.preset("fate", link="test_fast", budget=budget)) as rt:
        assert rt.plan.cache_total == 1
    # INT4: the buffers shrink too, plus one fp32 scratch expert that a packed slot is dequantized into;
    # (budget - dense - KV - 6 x 6912 - 49152) // 6912 = (6 x 42240) // 6912 = 36
    with offload(model, OffloadConfig.preset("fate_quant", link="test_fast", budget=budget)) as rt:
        assert rt.slot_expert_bytes == int4  # the largest precision that travels (INT4 > INT2)
        assert rt.plan.cache_total == min((6 * (fp - int4)) // int4, 2 * 16) == 32  # capped at 2 layers x 16
        assert rt.plan.buffer_bytes == 6 * int4 + fp
        assert sum(rt.slots_per_layer) == 32  # 36 slots, capped at 2 layers x 16 experts
        assert rt.describe()["device_slot_bytes"] == (32 + 6) * int4 + fp  # packed slots + fp scratch


@pytest.mark.parametrize("preset, quant", [("fate_quant", "fate"), ("fate_int8", "int8"), ("fate", "int4"),
                                           ("lru", "int4"), ("load_on_demand", "fate")])
def test_quantized_runtime_fits_its_budget_with_packed_slots(preset, quant):
    """Like test_every_preset_matches_plain_model for fp: slots + dense + planned KV fit the budget,
    because the device slots really hold packed bytes (plus one fp scratch expert)."""
    model = _model(seed=5)
    a = adapt(model)
    ids = prompt_ids(model.config.vocab_size, n=12, seed=6)
    spec = None if quant == "fate" else QuantSpec.preset(quant)
    if spec is not None:
        ref_tokens, ref_logits = _generate(quantize_model_experts(model, spec), ids)
    int4 = _hand_expert_bytes(64, 64, 4, 64)
    budget = a.dense_bytes() + a.kv_bytes_per_token() * 512 + 2 * a.bytes_per_expert() + 10 * int4  # ~11 INT4 slots
    with offload(model, OffloadConfig.preset(preset, link="test_fast", budget=budget, quant=quant)) as rt:
        tokens, logits = _generate(model, ids)
        kv = a.kv_bytes_per_token() * rt.config.context_len
        assert rt.device_bytes() + kv <= budget
        # exactly what the plan counts: dense + KV + staging (packed) + fp scratch + the packed cache slots
        cached = sum(rt.slots_per_layer)
        assert rt.device_bytes() + kv == rt.plan.min_budget_bytes + cached * rt.slot_expert_bytes
        if rt.config.cache.keep:  # the cache took every slot the budget buys: less than one slot is left over
            assert cached == rt.plan.cache_total > 0
            assert budget - (rt.device_bytes() + kv) < rt.slot_expert_bytes
        pool = rt.packed_slots.pool
        assert pool.dtype == torch.uint8 and pool.shape == (cached + rt.n_staging, rt.slot_expert_bytes)
        assert rt.gate_up_slots.shape[0] == 1  # the only fp expert on the device: the dequantize scratch
        held = {s for s in rt.packed_slots.spec_of if s is not None}
    if quant == "fate":  # INT2 misses sit in INT4-sized slots in their own packed form
        assert {s.bits for s in held} == {2, 4} or preset == "load_on_demand" and 2 in {s.bits for s in held}
    else:
        assert torch.equal(tokens, ref_tokens), preset
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_packed_slot_holds_the_packed_bytes_and_dequantizes_like_the_host_copy():
    from fate_lab.offloading.slots import PackedSlots

    model = _model()
    base = RamStore.from_adapter(adapt(model))
    int4, int2 = QuantSpec.preset("int4"), QuantSpec.preset("int2")
    store = QuantizedStore(base, [(int4, int2), (int4, int2)])
    slots = PackedSlots({"gate_up": (128, 64), "down": (64, 64)}, (int4, int2), torch.float32, n_slots=2, n_scratch=1,
                        device="cpu")
    assert slots.slot_bytes == 6912 and slots.nbytes == 2 * 6912 + 49152
    eng = EmulatedEngine(store, slots, LinkProfile("fast", 1e12, 0.0))
    try:
        a, b = eng.submit(0, 3, 0, spec=int4), eng.submit(1, 5, 1, spec=int2)
        assert eng.wait(a) and eng.wait(b) and (a.nbytes, b.nbytes) == (6912, 4608)
    finally:
        eng.close()
    assert slots.spec_of == [int4, int2]
    for slot, (m, e, spec) in enumerate(((0, 3, int4), (1, 5, int2))):
        host = store.fetch_at(m, e, spec)
        dev = slots.view(slot)
        assert torch.equal(dev.gate_up.packed, host.gate_up.packed) and torch.equal(dev.down.zero, host.down.zero)
        w = slots.weights(slot)
        assert torch.equal(w.gate_up, host.gate_up.dequantize()) and torch.equal(w.down, host.down.dequantize())


def test_a_packed_slot_rewritten_at_another_precision_is_read_at_that_precision():
    # the views of every slot are made up front, one set per precision: a slot that held an INT4 expert and is then
    # written at INT2 must be read (viewed and dequantized) as the INT2 bytes, and back again
    from fate_lab.offloading.slots import PackedSlots

    model = _model()
    int4, int2 = QuantSpec.preset("int4"), QuantSpec.preset("int2")
    store = QuantizedStore(RamStore.from_adapter(adapt(model)), [(int4, int2), (int4, int2)])
    slots = PackedSlots({"gate_up": (128, 64), "down": (64, 64)}, (int4, int2), torch.float32, n_slots=1, n_scratch=1,
                        device="cpu")
    for m, e, spec in ((0, 3, int4), (1, 5, int2), (0, 6, int4)):
        slots.write(0, store.fetch_at(m, e, spec), spec, non_blocking=False)
        host = store.fetch_at(m, e, spec)
        assert slots.spec_of[0] == spec and torch.equal(slots.view(0).down.packed, host.down.packed)
        w = slots.weights(0)
        assert torch.equal(w.gate_up, host.gate_up.dequantize()) and torch.equal(w.down, host.down.dequantize())


def test_emulated_link_holds_for_the_packed_bytes_and_dequantizes_into_the_slot():
    model = _model()
    base = RamStore.from_adapter(adapt(model))
    int4 = QuantSpec.preset("int4")
    store = QuantizedStore(base, [(int4,), (int4,)])
    slots = FullSlots.empty(2, {n: t.shape for n, t in base.fetch(0, 0).tensors().items()}, torch.float32, "cpu")
    gu, dn = slots.gate_up, slots.down  # (2, 2I, H), (2, H, I)
    fp_bytes = base.fetch(0, 0).nbytes()
    link = LinkProfile("slow", bandwidth=fp_bytes / 0.2, latency=0.0)  # 200 ms per fp32 expert
    eng = EmulatedEngine(store, slots, link)
    try:
        q = eng.submit(0, 3, 0, spec=int4)
        f = eng.submit(1, 5, 1)
        assert eng.wait(q) and eng.wait(f)
        assert q.nbytes == 6912 and f.nbytes == fp_bytes == 49152
        assert q.t_end - q.t_start >= 0.2 * 6912 / 49152 and f.t_end - f.t_start >= 0.2  # held for its bytes
        assert q.t_end - q.t_start < f.t_end - f.t_start  # the packed expert holds the link for less
        packed = store.fetch_at(0, 3, int4)
        torch.testing.assert_close(gu[0], packed.gate_up.dequantize(), rtol=0, atol=0)
        torch.testing.assert_close(dn[0], packed.down.dequantize(), rtol=0, atol=0)
        torch.testing.assert_close(gu[1], base.fetch(1, 5).gate_up, rtol=0, atol=0)
    finally:
        eng.close()
    with pytest.raises(ValueError, match="no packed copy"):
        store.fetch_at(0, 0, QuantSpec.preset("int2"))


@pytest.mark.parametrize("model_name", embedded_models())
def test_embedded_model_int8_greedy_output_matches_on_heldout_prompts(model_name, embedded_model):
    from fate_lab.model.corpus import heldout_prompts

    model, tok = embedded_model(model_name)
    agree = total = 0
    for prompt in heldout_prompts(2, max_chars=120):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        ref, _ = _generate(model, ids, n=8)
        with offload(model, OffloadConfig.preset("fate_int8", link="test_fast", slots=64)):
            out, _ = _generate(model, ids, n=8)
        agree += (out[0, ids.shape[1]:] == ref[0, ids.shape[1]:]).sum().item()
        total += 8
    assert agree == total, f"INT8 greedy agreement {agree}/{total} tokens"  # 128/128 on 8 prompts x 16 when written


def test_ssd_store_with_quantization_matches_the_ram_store(tmp_path):
    model = _model(seed=6)
    model.save_pretrained(tmp_path)
    ids = prompt_ids(model.config.vocab_size, seed=2)
    with offload(model, OffloadConfig.preset("fate", link="test_fast", slots=4, quant="int4")):
        ram_tokens, ram_logits = _generate(model, ids)
    cfg = OffloadConfig.preset("fate", link="test_fast", slots=4, quant="int4", store="ssd", checkpoint=str(tmp_path))
    with offload(model, cfg) as rt:
        tokens, logits = _generate(model, ids)
        assert rt.store.describe().startswith("ssd") and "int4/g64" in rt.store.describe()
    assert torch.equal(tokens, ram_tokens)
    torch.testing.assert_close(logits, ram_logits, rtol=0, atol=1e-6)


def test_stepwise_forward_equals_the_full_forward():
    from fate_lab.offloading.runtime import StepwiseForward

    model = _model(seed=7)
    ids = prompt_ids(model.config.vocab_size, n=6, seed=4)
    torch.testing.assert_close(StepwiseForward(model)(input_ids=ids).logits, model(input_ids=ids).logits,
                               rtol=1e-4, atol=1e-4)
    with offload(model, OffloadConfig.preset("fate_int8", link="test_fast", slots=4)) as rt:
        StepwiseForward(model)(input_ids=ids)
    s = rt.stats.summary()
    # one phase rule: a forward with no KV cache yet is a prefill, even of one token
    assert s["prefill"]["forwards"] == 1 and s["decode"]["forwards"] == 5


@pytest.mark.parametrize("name", ["int8", "int4", "int3", "int2"])
def test_device_side_dequantize_is_bit_exact(name):
    from fate_lab.offloading.slots import _dequantize_into
    from fate_lab.quant import quantize

    w = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))  # (2I, H)
    q = quantize(w, QuantSpec.preset(name))
    for dtype in (torch.float32, torch.bfloat16):
        ref = q.dequantize(dtype)
        assert torch.equal(_dequantize_into(q, torch.empty(128, 64, dtype=dtype)), ref)
        out = torch.empty(2, 64, 128, dtype=dtype).transpose(1, 2)[0]  # a non-contiguous target
        assert torch.equal(_dequantize_into(q, out), ref)
