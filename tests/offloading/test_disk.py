"""link="disk": every expert that moves is read from the checkpoint with O_DIRECT, digest-checked, and the tokens stay
the plain model's; a truncated, swapped or vanished file is a clear error and the caller keeps its model."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from helpers import embedded_models, greedy, prompt_ids

from fate_lab.core.config import OffloadConfig
from fate_lab.model.models import load_model
from fate_lab.offloading.direct import ALIGN, DirectIOError, aligned_buffer, open_direct, read_ranges, span
from fate_lab.offloading.runtime import offload
from fate_lab.offloading.store import CheckpointError
from fate_lab.paths import model_dir

N = 6


def _disk(ckpt, preset="load_on_demand", **over) -> OffloadConfig:
    return OffloadConfig.preset(preset, link="disk", store="ssd", checkpoint=str(ckpt), **over)


def test_read_ranges_returns_the_bytes_a_plain_read_returns(tmp_path):
    path = tmp_path / "blob"
    data = np.random.default_rng(0).integers(0, 256, 5 * ALIGN + 123, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    ranges = [(ALIGN * 3 + 7, 100), (5, 4000), (4100, ALIGN), (5 * ALIGN, 123)]  # unaligned, touching, to the end
    buf = aligned_buffer(span(ranges))
    views = read_ranges(path, ranges, buf)
    for (off, n), v in zip(ranges, views, strict=True):
        assert bytes(v) == data[off:off + n].tobytes()
    with pytest.raises(DirectIOError, match=r"truncated: bytes .* lie past its end"):
        read_ranges(path, [(5 * ALIGN, 200)], buf)
    with pytest.raises(DirectIOError, match="vanished"):
        read_ranges(tmp_path / "gone", [(0, 10)], buf)


def test_a_file_system_that_refuses_o_direct_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "blob"
    path.write_bytes(b"x" * ALIGN)

    def refuse(p, flags, *args):  # what open(2) answers on a file system without O_DIRECT
        raise OSError(errno.EINVAL, "Invalid argument") if flags & os.O_DIRECT else AssertionError("a buffered open")

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(DirectIOError, match="cannot open with O_DIRECT.*refuses reads that bypass the page cache"):
        open_direct(path)


@pytest.mark.parametrize("name", embedded_models())
def test_every_lossless_preset_keeps_the_plain_tokens_reading_from_disk(name):
    model, _ = load_model(name)
    ids = prompt_ids(model.config.vocab_size)
    ref = greedy(model, ids, N)[0]
    for preset in OffloadConfig.preset_names():
        if OffloadConfig.preset(preset).host is not None:  # the experts are on disk, not in host RAM: refused
            with pytest.raises(ValueError, match=r"link='disk'.*first read it from the disk.*set host=None"):
                _disk(model_dir(name), preset, slots=8)
            continue
        with offload(model, _disk(model_dir(name), preset, slots=8)) as rt:
            assert torch.equal(greedy(model, ids, N)[0], ref), preset
            assert rt.describe()["store"].startswith("disk O_DIRECT")
            if preset != "all_resident":
                assert rt.stats.summary()["decode"]["misses"] > 0, preset
    assert torch.equal(greedy(model, ids, N)[0], ref)


@pytest.mark.slow  # quantizing every expert at offload: minutes on this machine
@pytest.mark.parametrize("preset", ["fate_quant"])  # lru_quant packs the same way: one is the check
def test_quantized_presets_read_their_packed_copies_from_disk(preset, tmp_path, monkeypatch):
    monkeypatch.setenv("FATE_LAB_CACHE", str(tmp_path))
    model, _ = load_model("tiny_moe")
    ids = prompt_ids(model.config.vocab_size)
    over = {"link": "instant", "store": "ssd", "checkpoint": str(model_dir("tiny_moe")), "slots": 8}
    with offload(model, OffloadConfig.preset(preset, **over)) as rt:
        want = greedy(model, ids, N)[0]  # the same quantized run with the packed copies in RAM
        in_ram = rt.store.nbytes_at(0, 0, rt.core.quant.host_specs(0)[-1])
    with offload(model, _disk(model_dir("tiny_moe"), preset, slots=8)) as rt:
        assert torch.equal(greedy(model, ids, N)[0], want)
        (packed,) = (tmp_path / "packed").glob("experts-*.bin")  # written once, on the disk
        assert rt.store.file.path == packed
        spec = rt.core.quant.host_specs(0)[-1]
        assert rt.store.nbytes_at(0, 0, spec) == in_ram < rt.expert_bytes  # a load reads the packed bytes
        stamp = packed.stat().st_mtime_ns
    with offload(model, _disk(model_dir("tiny_moe"), preset, slots=8)) as rt:  # found again, not rewritten
        assert torch.equal(greedy(model, ids, N)[0], want)
    assert packed.stat().st_mtime_ns == stamp and len(list((tmp_path / "packed").iterdir())) == 2


def test_fused_transposed_experts_are_read_by_their_byte_ranges(tmp_path, tiny_models):
    model = tiny_models("gpt_oss", seed=1)  # fused [E, ...] tensors read by row, transposed, with biases
    model.save_pretrained(tmp_path / "ckpt")
    ids = prompt_ids(model.config.vocab_size)
    ref = greedy(model, ids, N)[0]
    with offload(model, _disk(tmp_path / "ckpt", "lru", slots=4)) as rt:
        assert torch.equal(greedy(model, ids, N)[0], ref)
        assert rt.stats.summary()["decode"]["misses"] > 0


def _saved(tiny_models, tmp_path, seed=0, name="ckpt"):
    model = tiny_models("qwen2_moe", seed=seed)
    model.save_pretrained(tmp_path / name)
    return model, tmp_path / name


def _mid_run(model, ckpt, damage, match, direct=False):
    """Offload over the disk, damage the checkpoint after ten transfers; the error is clear, the model comes back
    (direct: each expert read straight into its slot by its byte plan, `direct_reads=True`)."""
    ids = prompt_ids(model.config.vocab_size)
    ref = greedy(model, ids, N)[0]
    moved = []

    def after_ten(m, e):
        moved.append((m, e))
        if len(moved) == 10:
            damage()
        return False

    rt = offload(model, _disk(ckpt, direct_reads=direct))
    assert "conversion" not in rt.describe()["store"]  # every layer has a byte plan (used when direct)
    rt.set_fault(after_ten)
    with pytest.raises(CheckpointError, match=match):
        greedy(model, ids, N)
    assert len(moved) >= 10 and not any(t.is_alive() for t in rt.threads)  # the readers stopped: nothing hangs
    assert torch.equal(greedy(model, ids, N)[0], ref)  # the caller's own model, whole


@pytest.mark.parametrize("direct", [False, True])
def test_a_file_truncated_mid_run_is_named_and_the_model_comes_back(tmp_path, tiny_models, direct):
    model, ckpt = _saved(tiny_models, tmp_path)
    file = ckpt / "model.safetensors"
    _mid_run(model, ckpt, lambda: os.truncate(file, file.stat().st_size // 2),
             r"cannot read expert \d+ of MoE layer \d from .*model\.safetensors.*truncated", direct)


@pytest.mark.parametrize("direct", [False, True])
def test_a_file_swapped_mid_run_is_refused_and_the_model_comes_back(tmp_path, tiny_models, direct):
    model, ckpt = _saved(tiny_models, tmp_path)
    _, other = _saved(tiny_models, tmp_path, seed=5, name="other")
    _mid_run(model, ckpt, lambda: shutil.copy(other / "model.safetensors", ckpt / "model.safetensors"),
             r"expert \d+ of MoE layer \d read from .*model\.safetensors.* is not the expert verified at offload",
             direct)


@pytest.mark.parametrize("direct", [False, True])
def test_a_file_that_vanishes_mid_run_is_named_and_the_model_comes_back(tmp_path, tiny_models, direct):
    model, ckpt = _saved(tiny_models, tmp_path)
    _mid_run(model, ckpt, lambda: shutil.rmtree(ckpt), r"cannot read expert \d+ of MoE layer \d .*vanished", direct)


def test_the_disk_link_needs_the_ssd_store(tiny_models):
    with pytest.raises(ValueError, match=r"link='disk' reads experts from the checkpoint's files: set store='ssd'"):
        offload(tiny_models("qwen2_moe"), OffloadConfig.preset("lru", link="disk", slots=4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_disk_link_on_cuda_keeps_the_plain_tokens(tmp_path, tiny_models):
    # the reader copies each expert from its host buffer into the device slot on its own CUDA stream
    from fate_lab.offloading.load import load_offloaded

    model = tiny_models("qwen2_moe", seed=9)
    model.save_pretrained(tmp_path / "ckpt")
    ids = prompt_ids(model.config.vocab_size)
    ref_tokens, ref_logits = greedy(model.to("cuda"), ids.to("cuda"), N)
    cfg = OffloadConfig.preset("fate", link="disk", store="ssd", slots=4)
    opened, _, rt = load_offloaded(tmp_path / "ckpt", cfg, device="cuda")
    try:
        assert rt.gate_up_slots.is_cuda and rt.describe()["store"].startswith("disk O_DIRECT")
        tokens, logits = greedy(opened, ids.to("cuda"), N)
        assert rt.stats.summary()["decode"]["misses"] > 0
    finally:
        rt.close()
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
