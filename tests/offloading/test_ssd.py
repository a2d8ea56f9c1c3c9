"""The SSD tier never computes with weights that are not the model's, and a checkpoint opens offloaded:
full-content digests taken once and re-checked on every read; close() gives the caller its own
tensors or was refused up front; `load_offloaded` serves the experts from the files alone.

Every edit below leaves an expert's first and last rows as they were: the SSD tier used to compare only those.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from helpers import greedy, prompt_ids
from safetensors.torch import load_file, save_file

from fate_lab.core.config import OffloadConfig
from fate_lab.model.adapters import adapt
from fate_lab.offloading.load import load_offloaded
from fate_lab.offloading.runtime import offload
from fate_lab.offloading.store import CheckpointError

KEY = "model.layers.1.mlp.experts.3.down_proj.weight"  # expert 3 of MoE layer 1 (qwen2_moe saves per-expert keys)
N = 6


def _ssd(ckpt, **over) -> OffloadConfig:
    return OffloadConfig.preset("load_on_demand", link="instant", store="ssd", checkpoint=str(ckpt), **over)


def _saved(model, tmp_path, name="ckpt"):
    model.save_pretrained(tmp_path / name)
    return tmp_path / name


def _edit(ckpt, fn) -> None:
    """Rewrite the checkpoint with fn applied to KEY's tensor (in place on a copy of every tensor)."""
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    fn(tensors[KEY])  # (64, 32): rows 0 and 63 untouched
    save_file(tensors, path, metadata={"format": "pt"})


def _own(model):
    a = adapt(model)
    return [dict(a.experts_module(m).named_parameters(recurse=False)) for m in range(a.num_moe_layers)]


@pytest.mark.parametrize("edit,found", [
    (lambda t: t[8:56].mul_(50.0), r"down differs in 48 of 64 rows, the first at row 8"),
    (lambda t: t[30, 7:8].fill_(float("nan")), r"down differs in 1 of 64 rows, the first at row 30, 1 non-finite"),
])
def test_a_checkpoint_edited_in_its_middle_rows_is_refused_naming_file_and_expert(edit, found, tmp_path, tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    ckpt = _saved(model, tmp_path)
    _edit(ckpt, edit)
    own = _own(model)
    with pytest.raises(ValueError, match=rf"model\.safetensors: {KEY}.*expert 3 of MoE layer 1 differs from the "
                                         rf"in-memory model's \({found}"):
        offload(model, _ssd(ckpt))
    assert all(own[m][n] is p for m, layer in enumerate(_own(model)) for n, p in layer.items())  # nothing taken
    assert model.config._experts_implementation != "fate_offload"


def test_a_model_edited_in_memory_is_refused_against_its_checkpoint(tmp_path, tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    ckpt = _saved(model, tmp_path)
    with torch.no_grad():
        adapt(model).experts_module(1).down_proj[3, 20:40] *= 2.0  # middle rows of expert 3, MoE layer 1
    with pytest.raises(ValueError, match=r"expert 3 of MoE layer 1 differs .*down differs in 20 of 64 rows, the "
                                         r"first at row 20"):
        offload(model, _ssd(ckpt))


def test_a_checkpoint_swapped_during_generation_is_refused_and_the_caller_keeps_its_tensors(tmp_path, tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    ids = prompt_ids(model.config.vocab_size)
    ref = greedy(model, ids, N)[0]
    ckpt = _saved(model, tmp_path)
    other = _saved(tiny_models("qwen2_moe", seed=5), tmp_path, "other")  # same shapes, other weights
    own = _own(model)
    moved = []

    def swap_after_ten(m, e):  # the fault hook sees every transfer: swap the file under the running runtime
        moved.append((m, e))
        if len(moved) == 10:
            shutil.copy(other / "model.safetensors", ckpt / "model.safetensors")
        return False

    rt = offload(model, _ssd(ckpt))
    rt.set_fault(swap_after_ten)
    with pytest.raises(CheckpointError, match=r"expert \d+ of MoE layer \d read from .*model\.safetensors.* is not the "
                                              r"expert verified at offload.*swapped"):
        greedy(model, ids, N)
    assert len(moved) > 10
    assert all(own[m][n] is p for m, layer in enumerate(_own(model)) for n, p in layer.items())  # its own Parameters
    assert torch.equal(greedy(model, ids, N)[0], ref)  # ... with their own values


def test_a_checkpoint_that_vanishes_while_offloaded_is_named(tmp_path, tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    ckpt = _saved(model, tmp_path)
    ids = prompt_ids(model.config.vocab_size)
    ref = greedy(model, ids, N)[0]
    rt = offload(model, _ssd(ckpt))
    shutil.rmtree(ckpt)
    with pytest.raises(CheckpointError, match=r"cannot read expert \d+ of MoE layer \d from .*ckpt.*vanished"):
        greedy(model, ids, N)
    assert rt.describe()["store"].startswith("ssd") and torch.equal(greedy(model, ids, N)[0], ref)


def test_load_offloaded_serves_the_experts_from_the_files_and_says_what_close_leaves(tmp_path, tiny_models):
    model = tiny_models("gpt_oss", seed=1)  # transposed, interleaved, biased experts; a router with a bias
    ckpt = _saved(model, tmp_path)
    ids = prompt_ids(model.config.vocab_size)
    ref_tokens, ref_logits = greedy(model, ids, N)
    a = adapt(model)
    cfg = OffloadConfig.preset("fate", link="instant", store="ssd", slots=a.num_moe_layers * a.num_experts // 10)
    opened, tok, rt = load_offloaded(ckpt, cfg)
    assert tok is None  # a tiny model has no tokenizer files
    b = rt.adapter  # adapt() refuses a model while it is offloaded
    expert_bytes = sum(p.numel() * p.element_size() for m in range(b.num_moe_layers)
                       for p in b.experts_module(m).parameters(recurse=False))
    assert expert_bytes == 0  # no expert tensor holds bytes: the slots hold what the cache keeps
    tokens, logits = greedy(opened, ids, N)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert rt.describe()["store"].startswith("ssd") and rt.stats.summary()["decode"]["misses"] > 0
    rt.close()
    with pytest.raises(RuntimeError, match="opened with fate_lab.load_offloaded and its Runtime is closed"):
        opened(input_ids=ids)
    with pytest.raises(ValueError, match=r"experts are empty .*open it again with fate_lab.load_offloaded"):
        offload(opened, OffloadConfig.preset("lru", link="instant", slots=2))


def test_load_offloaded_refuses_a_corrupt_checkpoint_and_a_ram_store(tmp_path, tiny_models):
    model = tiny_models("qwen2_moe", seed=0)
    ckpt = _saved(model, tmp_path)
    with pytest.raises(ValueError, match=r"store='ssd'"):
        load_offloaded(ckpt, OffloadConfig.preset("fate", store="ram"))
    for auto in ("auto", "auto_quant"):  # calibrated with every expert resident: refused by name
        with pytest.raises(ValueError, match=rf"'{auto}' plans itself .* name a preset"):
            load_offloaded(ckpt, OffloadConfig.preset(auto, store="ssd", slots=4))
    _edit(ckpt, lambda t: t[30, 7:8].fill_(float("nan")))  # no in-memory copy: the file is checked for itself
    with pytest.raises(ValueError, match=r"model\.safetensors.*expert 3 of MoE layer 1: down holds 1 non-finite"):
        load_offloaded(ckpt, OffloadConfig.preset("fate", link="instant", store="ssd", slots=4))


def test_load_offloaded_refuses_a_file_swapped_after_opening(tmp_path, tiny_models):
    ckpt = _saved(tiny_models("qwen2_moe", seed=0), tmp_path)
    other = _saved(tiny_models("qwen2_moe", seed=5), tmp_path, "other")
    opened, _, rt = load_offloaded(ckpt, OffloadConfig.preset("load_on_demand", link="instant", store="ssd"))
    shutil.copy(other / "model.safetensors", ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="is not the expert verified at offload"):
        greedy(opened, prompt_ids(opened.config.vocab_size), N)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_close_refills_the_callers_own_parameters_and_ssd_is_refused(tmp_path, tiny_models):
    model = tiny_models("gpt_oss", seed=1).cuda()
    ckpt = _saved(model, tmp_path)
    ids = prompt_ids(model.config.vocab_size).cuda()
    ref = greedy(model, ids, N)[0]
    own = _own(model)
    values = [{n: p.detach().clone() for n, p in layer.items()} for layer in own]
    with pytest.raises(ValueError, match=r"store='ssd' with the model's experts in cuda memory"):
        offload(model, _ssd(ckpt))
    with offload(model, OffloadConfig.preset("fate", link="test_fast", slots=6)):
        assert all(p.numel() == 0 for layer in own for p in layer.values())  # the device copies were freed
        assert torch.equal(greedy(model, ids, N)[0], ref)
    after = _own(model)
    assert all(after[m][n] is p and torch.equal(p, values[m][n])
               for m, layer in enumerate(own) for n, p in layer.items())
    assert torch.equal(greedy(model, ids, N)[0], ref)


@pytest.mark.parametrize("family", ["gpt_oss", "nemotron_h"])
def test_the_accelerator_path_refills_the_callers_own_parameters_in_their_layout(family, tiny_models):
    """What close() does off the CPU, run on the CPU: the device storage of every expert tensor is freed (the
    Parameter objects kept), then refilled from the RAM store's host copy in the module's own layout (gpt-oss:
    transposed, with biases; Nemotron-H: up_proj without a gate) -- never from a file."""
    from fate_lab.offloading import hookup
    from fate_lab.offloading.store import RamStore

    model = tiny_models(family, seed=1)
    ids = prompt_ids(model.config.vocab_size)
    ref = greedy(model, ids, N)[0]
    a = adapt(model)
    own = _own(model)
    values = [{n: p.detach().clone() for n, p in layer.items()} for layer in own]
    store = RamStore([[a.expert(m, e).contiguous() for e in range(a.num_experts)] for m in range(a.num_moe_layers)],
                     pinned=False)  # a host copy, as an accelerator's runtime keeps one
    taken = hookup.free_fused_experts(a, torch.device("meta"))  # not the CPU: the accelerator branch
    assert not taken.on_host and all(p.numel() == 0 for layer in own for p in layer.values())
    hookup.restore_fused_experts(a, store, taken, torch.device("cpu"))
    after = _own(model)
    assert all(after[m][n] is p and torch.equal(p, values[m][n])
               for m, layer in enumerate(own) for n, p in layer.items())
    assert torch.equal(greedy(model, ids, N)[0], ref)


def test_reads_open_each_file_once_yet_see_a_replaced_file(tmp_path, tiny_models, monkeypatch):
    """Opening a safetensors file parses its header (milliseconds for a shard of a large MoE); the store's reads keep
    each file open and stat it per read, so a file replaced on disk is read anew, never served from the old open."""
    import fate_lab.model.checkpoint as checkpoint
    from fate_lab.offloading.store import SafetensorsStore

    model = tiny_models("qwen2_moe", seed=0)
    ckpt = _saved(model, tmp_path)
    opens = []
    real = checkpoint.safe_open
    monkeypatch.setattr(checkpoint, "safe_open", lambda *a, **k: opens.append(a[0]) or real(*a, **k))
    a = adapt(model)
    store = SafetensorsStore.open(a, ckpt)
    assert len(opens) <= 2  # the verification pass: one open per file (here one file; <= 2: an index build's check)
    opens.clear()
    for e in range(a.num_experts):
        w = store.fetch(1, e)
        assert torch.equal(w.down, a.expert(1, e).down)  # the model's own tensors: the independent reference
    assert len(opens) == 1
    _edit(ckpt, lambda t: t.mul_(2.0))  # a new file under the same name
    with pytest.raises(CheckpointError, match="expert 3 of MoE layer 1"):
        store.fetch(1, 3)
    assert len(opens) == 2
