"""Reliability: nothing hangs, a dead link fails loudly and gives the model back, one
forward at a time per runtime, and double offloading / recording an offloaded model say so."""
import threading

import pytest
import torch
from helpers import greedy, prompt_ids

from fate_lab.core.config import OffloadConfig
from fate_lab.model.adapters import adapt
from fate_lab.model.record import record_trace
from fate_lab.offloading.runtime import offload
from fate_lab.offloading.transfer import TransferError

N = 6


def _gen(model, ids, n=N):
    return greedy(model, ids, n)[0]


def _ids(model, seed=0):
    return prompt_ids(model.config.vocab_size, 7, seed)


def _in_thread(fn, timeout: float = 60.0):
    """Run fn in a thread; fail the test if it does not end in time (the hang this file guards against)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), f"still running after {timeout} s: a hang"
    return box


def _restored(model) -> bool:
    a = adapt(model)
    return all(a.experts_module(m).gate_up_proj.numel() > 0 for m in range(a.num_moe_layers)) and \
        model.config._experts_implementation != "fate_offload"


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt])
def test_a_dying_transfer_worker_fails_loudly_and_gives_the_model_back(exc, tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    ids = _ids(model)
    ref = _gen(model, ids)
    rt = offload(model, OffloadConfig.preset("lru", link="pcie3_x16", slots=2, transfer_timeout_s=20))

    def fault(m, e):
        raise exc("fault hook")

    rt.set_fault(fault)
    box = _in_thread(lambda: _gen(model, ids))
    assert isinstance(box.get("error"), TransferError) and "died" in str(box["error"])
    assert rt.threads == [] or not any(t.is_alive() for t in rt.engine.threads)
    assert _restored(model)
    assert torch.equal(_gen(model, ids), ref)  # the caller's weights, exactly


def test_a_blocking_store_read_times_out_naming_the_expert(tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    ids = _ids(model)
    release = threading.Event()
    rt = offload(model, OffloadConfig.preset("load_on_demand", link="pcie3_x16", transfer_timeout_s=1.0))
    rt.set_fault(lambda m, e: release.wait(30) and False)  # the first read blocks until released
    box = _in_thread(lambda: _gen(model, ids), timeout=30)
    release.set()
    err = box.get("error")
    assert isinstance(err, TransferError) and "did not arrive within 1 s" in str(err) and "MoE layer" in str(err)
    assert _restored(model)


def test_concurrent_generate_is_refused_never_wrong(tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    prompts = [_ids(model, s) for s in range(4)]
    refs = [_gen(model, p, 12) for p in prompts]
    results: list = [None] * 4
    with offload(model, OffloadConfig.preset("fate", link="pcie3_x16", slots=4)):
        def worker(i):
            try:
                results[i] = _gen(model, prompts[i], 12)
            except RuntimeError as exc:
                results[i] = exc

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert torch.equal(_gen(model, prompts[0], 12), refs[0])  # the runtime still works afterwards
    for r, ref in zip(results, refs, strict=True):
        if isinstance(r, Exception):
            assert "another forward is running" in str(r)
        else:
            assert torch.equal(r, ref)  # never a wrong token


def test_offloading_twice_and_recording_an_offloaded_model_say_so(tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    with offload(model, OffloadConfig.preset("lru", link="instant", slots=2)):
        with pytest.raises(RuntimeError, match="already offloaded"):
            offload(model, OffloadConfig.preset("lru", link="instant", slots=2))
        with pytest.raises(RuntimeError, match="offloaded by a fate_lab Runtime"):
            record_trace(model, None, [[1, 2, 3]], decode_tokens=1, progress=False)
    assert _restored(model)


def test_the_runtimes_own_threads_end_with_close(tiny_models):
    """By reference (threading.enumerate() only lists live threads, so it cannot show a leak)."""
    model = tiny_models("qwen2_moe", seed=0)
    rt = offload(model, OffloadConfig.preset("fate", link="pcie3_x16", slots=2))
    own = rt.threads
    assert own and all(t.is_alive() for t in own)
    _gen(model, _ids(model))
    rt.close()
    assert not any(t.is_alive() for t in own)


@pytest.mark.parametrize("field,value", [("budget", float("nan")), ("budget", 1.5), ("slots", "8"), ("slots", -1),
                                         ("layer_compute_s", 0.0), ("layer_compute_s", float("nan")),
                                         ("prefetch_budget", "some"), ("prefetch_window", 0)])
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        OffloadConfig.preset("fate", **{field: value})


def test_close_gives_back_exactly_the_tensors_it_took_on_cpu(tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    a = adapt(model)
    before = [(a.experts_module(m).gate_up_proj, a.experts_module(m).down_proj) for m in range(a.num_moe_layers)]
    with offload(model, OffloadConfig.preset("fate", link="instant", slots=2)):
        _gen(model, _ids(model))
    after = [(a.experts_module(m).gate_up_proj, a.experts_module(m).down_proj) for m in range(a.num_moe_layers)]
    assert all(x is y for pb, pa in zip(before, after, strict=True) for x, y in zip(pb, pa, strict=True))


def _saved(model, tmp_path):
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    return str(tmp_path / "ckpt")


def test_ssd_store_refuses_a_checkpoint_that_is_not_the_model(tmp_path, tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    ckpt = _saved(model, tmp_path)
    a = adapt(model)
    with torch.no_grad():
        a.experts_module(1).down_proj[3, -1, 0] += 1.0  # one edited weight of expert 3, layer 1
    with pytest.raises(ValueError,
                       match=r"experts\.3\.down_proj.*expert 3 of MoE layer 1 differs from the in-memory model's"):
        offload(model, OffloadConfig.preset("lru", link="instant", slots=2, store="ssd", checkpoint=ckpt))
    assert _restored(model)
    other = tiny_models("qwen2_moe", seed=0, hidden_size=48)  # another hidden size
    with pytest.raises(ValueError, match="has shape"):
        offload(other, OffloadConfig.preset("lru", link="instant", slots=2, store="ssd", checkpoint=ckpt))


def test_ssd_store_survives_its_file_vanishing_and_keeps_the_original_error(tmp_path, tiny_models):
    import shutil

    model = tiny_models("qwen2_moe", seed=0)
    ids = _ids(model)
    ref = _gen(model, ids)
    ckpt = _saved(model, tmp_path)
    with pytest.raises(KeyError, match="the error that ended the block"):
        with offload(model, OffloadConfig.preset("load_on_demand", link="instant", store="ssd", checkpoint=ckpt)):
            assert torch.equal(_gen(model, ids), ref)
            shutil.rmtree(ckpt)  # unreadable while offloaded
            raise KeyError("the error that ended the block")
    assert _restored(model) and torch.equal(_gen(model, ids), ref)
