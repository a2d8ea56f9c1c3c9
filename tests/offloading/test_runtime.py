"""Runtime tests: offloaded output == plain output for every preset, budget and family; faults,
closing, flat device memory, budget refusal, the SSD tier, and the link/transfer mechanics."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import embedded_models, greedy, prompt_ids
from transformers import TextStreamer

from fate_lab.hardware.links import LINK_PROFILES
from fate_lab.model.adapters import adapt
from fate_lab.offloading.runtime import OffloadConfig, Runtime, offload
from fate_lab.offloading.slots import FullSlots
from fate_lab.offloading.store import RamStore
from fate_lab.offloading.transfer import EmulatedEngine
from fate_lab.policy.registry import POLICIES

FAMILIES = ["qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "deepseek_v2", "deepseek_v3"]
PRESETS = OffloadConfig.preset_names()
# learned probes ship only for the embedded model (its test below runs fate_learned); a tiny random model has none
TINY_PRESETS = [n for n in PRESETS if OffloadConfig.preset(n).predictor != "learned_gate"]
NEW_TOKENS = 10





def _generate(model, ids, n=NEW_TOKENS, **kw):
    return greedy(model, ids, n, **kw)


def _small_budget(model) -> int:
    """Bytes for dense + KV + buffers + a quarter of all experts (per the planner's arithmetic)."""
    a = adapt(model)
    need = a.dense_bytes() + a.kv_bytes_per_token() * 512 + 2 * a.top_k * a.bytes_per_expert()
    return need + (a.num_moe_layers * a.num_experts // 4) * a.bytes_per_expert()


def _fate_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fate-transfer")]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_preset_matches_plain_model(family, tiny_models):
    model = tiny_models(family, seed=1)
    ids = prompt_ids(model.config.vocab_size)
    ref_tokens, ref_logits = _generate(model, ids)
    budgets = [dict(budget=_small_budget(model)), dict(slots=0)]  # a quarter of the experts; staging only
    for name in TINY_PRESETS:
        for budget in budgets:
            with offload(model, OffloadConfig.preset(name, link="test_fast", **budget)) as rt:
                assert all(rt.adapter.experts_module(m).gate_up_proj.numel() == 0 for m in range(len(rt.layers)))
                tokens, logits = _generate(model, ids)
                if "budget" in budget and name != "all_resident":  # slots + dense + planned KV fit the budget
                    kv = rt.adapter.kv_bytes_per_token() * rt.config.context_len
                    assert rt.device_bytes() + kv <= budget["budget"]
            assert torch.equal(tokens, ref_tokens), (family, name, budget)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
            s = rt.stats.summary()
            assert s["prefill"]["forwards"] == 1 and s["decode"]["forwards"] == NEW_TOKENS - 1
            d = s["decode"]
            assert d["hits"] + d["late"] + d["misses"] == d["uses"] > 0
    tokens, _ = _generate(model, ids)  # close() put the experts back: the plain model works again
    assert torch.equal(tokens, ref_tokens)


def test_preset_semantics_in_stats(tiny_models):
    model = tiny_models("qwen2_moe", seed=2)
    ids = prompt_ids(model.config.vocab_size)
    with offload(model, OffloadConfig.preset("load_on_demand", link="test_fast")) as rt:
        _generate(model, ids)
    d = rt.stats.summary()["decode"]
    assert d["hits"] == 0 and d["misses"] == d["uses"] and d["prefetch_issued"] == 0
    assert d["bytes_moved"] == d["misses"] * rt.expert_bytes
    with offload(model, OffloadConfig.preset("all_resident", link="test_fast")) as rt:
        _generate(model, ids)
    s = rt.stats.summary()
    assert s["decode"]["misses"] == s["prefill"]["misses"] == 0 and s["decode"]["bytes_moved"] == 0
    with offload(model, OffloadConfig.preset("fate", link="test_fast", slots=4)) as rt:
        _generate(model, ids)
    d = rt.stats.summary()["decode"]
    assert d["predictions"] > 0 and 0 < d["recall"] <= 1 and 0 < d["precision"] <= 1
    assert d["prefetch_useful"] + d["prefetch_wasted"] <= d["prefetch_issued"] + 1
    kinds = {ev[0] for ev in rt.stats.timeline}
    assert {"compute", "prefetch"} <= kinds
    assert "test link" in rt.stats.link


def test_sampling_matches_plain_model(tiny_models):
    model = tiny_models("olmoe", seed=3)
    ids = prompt_ids(model.config.vocab_size)
    torch.manual_seed(7)
    ref = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
    with offload(model, OffloadConfig.preset("fate", link="test_fast", slots=3)):
        torch.manual_seed(7)
        out = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, pad_token_id=0)
    assert torch.equal(out, ref)


def test_failed_transfer_loads_synchronously(tiny_models):
    model = tiny_models("mixtral", seed=4)
    ids = prompt_ids(model.config.vocab_size)
    ref_tokens, ref_logits = _generate(model, ids)
    for name in ("load_on_demand", "fate"):
        with offload(model, OffloadConfig.preset(name, link="test_fast", slots=2)) as rt:
            rt.set_fault(lambda m, e: e % 2 == 0)  # every transfer of an even expert fails
            tokens, logits = _generate(model, ids)
        assert torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert sum(s["failures"] for s in rt.stats.summary().values()) > 0
        assert any(ev[0] == "sync_load" for ev in rt.stats.timeline)


def test_close_stops_workers_and_restores_model(tiny_models):
    before = len(_fate_threads())
    model = tiny_models("qwen3_moe", seed=5)
    rt = offload(model, OffloadConfig.preset("fate", link="test_fast", slots=2))
    assert len(_fate_threads()) == before + 1 and all(t.is_alive() for t in rt.threads)
    _generate(model, prompt_ids(model.config.vocab_size), n=3)
    rt.close()
    assert len(_fate_threads()) == before and not any(t.is_alive() for t in rt.threads)
    assert model.config._experts_implementation != "fate_offload"
    rt.close()  # idempotent


def test_long_generation_keeps_device_memory_flat(tiny_models):
    model = tiny_models("qwen2_moe", seed=6, max_position_embeddings=512)
    with offload(model, OffloadConfig.preset("fate", link="test_fast", slots=5)) as rt:
        ptrs = [t.data_ptr() for t in rt.device_tensors()]
        nbytes, n_params = rt.device_bytes(), len(list(model.parameters()))
        _generate(model, prompt_ids(model.config.vocab_size), n=300)
        assert [t.data_ptr() for t in rt.device_tensors()] == ptrs
        assert rt.device_bytes() == nbytes and len(list(model.parameters())) == n_params
        rt.cache.check_slots()  # no staging slot lost over 300 tokens
        assert rt.stats.summary()["decode"]["forwards"] == 299


def test_budget_below_minimum_is_refused(tiny_models):
    model = tiny_models("olmoe", seed=0)
    a = adapt(model)
    with pytest.raises(ValueError, match="minimum"):
        offload(model, OffloadConfig.preset("fate", budget=a.dense_bytes(), link="test_fast"))
    assert not _fate_threads() or all(t.is_alive() for t in _fate_threads())
    assert a.experts_module(0).gate_up_proj.numel() > 0  # nothing was taken from the model
    with pytest.raises(ValueError, match="preset"):
        OffloadConfig.preset("nope")
    with pytest.raises(TypeError):
        OffloadConfig.preset("fate", bogus=1)


def test_ssd_store_reads_experts_from_safetensors(tmp_path, tiny_models):
    model = tiny_models("qwen2_moe", seed=8)
    model.save_pretrained(tmp_path)
    ids = prompt_ids(model.config.vocab_size)
    ref_tokens, _ = _generate(model, ids)
    cfg = OffloadConfig.preset("lru", link="test_fast", slots=4, store="ssd", checkpoint=str(tmp_path))
    with offload(model, cfg) as rt:
        tokens, _ = _generate(model, ids)
        assert rt.store.describe().startswith("ssd")
    assert torch.equal(tokens, ref_tokens)


def test_emulated_link_overlaps_with_compute_and_holds_for_link_time(tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    store = RamStore.from_adapter(adapt(model))
    slots = FullSlots.empty(2, {n: t.shape for n, t in store.fetch(0, 0).tensors().items()}, torch.float32, "cpu")
    slots_gu, slots_d = slots.gate_up, slots.down
    nbytes = store.fetch(0, 0).nbytes()
    link = LINK_PROFILES["test_fast"].__class__("slow", bandwidth=nbytes / 0.05, latency=0.0)  # 50 ms each
    eng = EmulatedEngine(store, slots, link)
    try:
        t0 = time.perf_counter()
        a, b = eng.submit(0, 3, 0), eng.submit(1, 5, 1)
        time.sleep(0.05)  # "compute" while the link works
        assert eng.wait(a) and eng.wait(b)
        # counts and order, not wall-clock bounds: each transfer holds the link for at least its time,
        # and the link moves one expert after the other
        assert a.t_end - a.t_start >= 0.05 and b.t_end - b.t_start >= 0.05 and b.t_start >= a.t_end
        assert a.t_start >= t0
        torch.testing.assert_close(slots_gu[0], store.fetch(0, 3).gate_up, rtol=0, atol=0)
        torch.testing.assert_close(slots_d[1], store.fetch(1, 5).down, rtol=0, atol=0)
        c = eng.submit(0, 1, 0)
        time.sleep(0.01)
        assert not eng.cancel(c)  # already on the link
        d, x = eng.submit(0, 2, 1), eng.submit(0, 6, 1)
        u = eng.submit(0, 4, 0, urgent=True)  # jumps ahead of the queued prefetches d and x
        assert eng.cancel(x) and x.cancelled and x.done.is_set()
        assert eng.wait(u) and eng.wait(d) and u.t_start < d.t_start
        own = eng.threads
    finally:
        eng.close()
    assert own and not any(t.is_alive() for t in own)


@pytest.mark.parametrize("model_name", embedded_models())
def test_embedded_model_every_preset(model_name, embedded_model):
    model, tok = embedded_model(model_name)
    a = adapt(model)
    ids = tok("The expert cache", return_tensors="pt")["input_ids"]
    ref_tokens, ref_logits = _generate(model, ids, n=8)
    half = a.num_moe_layers * a.num_experts // 2
    online = [n for n, p in POLICIES.items() if not p.reads_future]  # every registered policy a runtime can run
    runs = [(n, {}) for n in PRESETS] + [("fate", {"replacement": r}) for r in online]
    for name, over in runs:
        for budget in (dict(slots=half), dict(slots=a.num_moe_layers * a.top_k)):
            with offload(model, OffloadConfig.preset(name, link="test_fast", **budget, **over)):
                tokens, logits = _generate(model, ids, n=8)
            assert torch.equal(tokens, ref_tokens), (name, over, budget)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-3, atol=1e-3)
    seen: list[str] = []

    class Collect(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False):
            seen.append(text)

    with offload(model, OffloadConfig.preset("fate", link="test_fast", slots=half)):
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, streamer=Collect(tok))
    assert "".join(seen).strip() == tok.decode(ref_tokens[0]).strip()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("native", [True, False])
def test_cuda_offload_matches_plain(native, tiny_models):
    model = tiny_models("qwen2_moe", seed=9).to("cuda")
    ids = prompt_ids(model.config.vocab_size).to("cuda")
    ref_tokens, ref_logits = _generate(model, ids)
    with offload(model, OffloadConfig.preset("fate", link="test_fast", slots=4, native_link=native)) as rt:
        assert rt.gate_up_slots.is_cuda and (not native or rt.store.pinned)
        rt.set_fault(lambda m, e: e == 1)
        tokens, logits = _generate(model, ids)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


def test_learned_probes_of_another_model_are_refused(tiny_models):
    model = tiny_models("olmoe", seed=0)
    with pytest.raises(ValueError, match="probes are for a model"):
        offload(model, OffloadConfig.preset("fate_learned", link="instant", slots=4))
    tokens, _ = _generate(model, prompt_ids(model.config.vocab_size))  # refused before anything was freed
    assert tokens.shape[1] > 0


def test_each_preset_does_what_its_name_says(tiny_models):
    """Counts on an instant link pin each preset's mechanism (not merely that it exists)."""
    model = tiny_models("qwen2_moe", seed=0)
    ids = prompt_ids(model.config.vocab_size)
    a = adapt(model)
    summary = {}
    for name in TINY_PRESETS:
        with offload(model, OffloadConfig.preset(name, link="instant", slots=a.num_moe_layers * 2)) as rt:
            _generate(model, ids)
            summary[name] = (rt.stats.summary(), list(rt.slots_per_layer))
    dec = {k: v[0]["decode"] for k, v in summary.items()}
    assert dec["all_resident"]["bytes_moved"] == 0 and dec["all_resident"]["hit_rate"] == 1.0
    assert dec["load_on_demand"]["hits"] == 0 and dec["load_on_demand"]["prefetch_issued"] == 0
    assert dec["lru"]["prefetch_issued"] == 0 and dec["lru"]["hits"] > 0
    for name in ("mixtral_offloading", "activation_path", "fate", "fate_v1"):
        assert dec[name]["prefetch_issued"] > 0, name
    assert dec["mixtral_offloading"]["set_size"] == a.top_k  # plain top-k of the next router
    assert dec["fate"]["set_size"] >= a.top_k  # the 75th percentile keeps the top quarter of E (>= k here)
    assert summary["lru"][1] == [2] * a.num_moe_layers  # uniform
    assert summary["fate"][1][0] > summary["fate"][1][-1]  # shallow-favoring
    assert isinstance(Runtime, type)


def test_every_allocation_runs_in_the_runtime(tiny_models):
    """miss_curve included: calibrated at offload time when no curves are given (it raised a TypeError before)."""
    model = tiny_models("qwen2_moe", seed=0)
    ids = prompt_ids(model.config.vocab_size)
    ref_tokens, _ = _generate(model, ids)
    a = adapt(model)
    for alloc in ("uniform", "shallow", "miss_curve"):
        with offload(model, OffloadConfig.preset("fate", link="instant", slots=a.num_moe_layers * 2,
                                                 allocation=alloc)) as rt:
            tokens, _ = _generate(model, ids)
            assert sum(rt.slots_per_layer) == a.num_moe_layers * 2
        assert torch.equal(tokens, ref_tokens), alloc
