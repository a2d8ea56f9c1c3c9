"""Experts read from the disk straight into their slots by a byte plan: the bytes that land are the plain model's,
bfloat16 and float16 widen to float32 bit for bit as torch widens them, packed copies land as the copy path writes
them, and a layout the plan cannot follow (transposed) keeps transformers' conversion, named."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import embedded_models

from fate_lab.model.adapters import adapt
from fate_lab.model.experts import ExpertWeights
from fate_lab.model.models import load_model
from fate_lab.offloading.byte_plan import BF16_F32, COPY, F16_F32, BytePlan
from fate_lab.offloading.digest import expert_digest, tensor_bytes
from fate_lab.offloading.direct import aligned_buffer
from fate_lab.offloading.disk import DiskStore
from fate_lab.offloading.packed_file import PackedFile, write_packed
from fate_lab.offloading.slots import PackedSlots
from fate_lab.paths import model_dir
from fate_lab.quant.experts import pack_expert
from fate_lab.quant.kernels import QuantSpec


def _regions(w) -> dict:
    return {n: (np.zeros(t.numel() * t.element_size(), dtype=np.uint8), t.dtype) for n, t in w.tensors().items()}


@pytest.mark.parametrize("name", embedded_models())
def test_every_expert_lands_as_the_plain_model_holds_it(name):
    model, _ = load_model(name)
    a = adapt(model)
    store = DiskStore.open(a, model_dir(name))
    store.plan()
    assert store.no_plan == {} and store.describe() == f"disk O_DIRECT ({model_dir(name)})"
    for m in range(a.num_moe_layers):
        for e in range(a.num_experts):
            want = a.expert(m, e)  # the un-offloaded model's own tensors
            got = _regions(want)
            assert store.read_into(m, e, None, got), (m, e)
            for n, t in want.tensors().items():
                assert bytes(got[n][0]) == bytes(tensor_bytes(t.contiguous())), (m, e, n)
    assert not store.read_into(0, 0, QuantSpec(4, 32), _regions(a.expert(0, 0)))  # packed copies: not this store's
    assert not store.read_into(0, 0, None, {"gate_up": _regions(a.expert(0, 0))["gate_up"]})  # not its tensors


def _file_plan(tmp_path, src: torch.Tensor, how: int, dtype: torch.dtype):
    data = src.reshape(-1).view(torch.uint8).numpy().tobytes()
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 100 + data)
    ranges = {path: [("w", None, 100, len(data), src.dtype, tuple(src.shape))]}
    plan = BytePlan(copies=(("w", 0, 0, 0, src.numel(), how),), headers=(("w", b"w;"),),
                    tensors=(("w", dtype, src.numel() * dtype.itemsize),))
    out = {"w": (np.zeros(src.numel() * dtype.itemsize, dtype=np.uint8), dtype)}
    assert plan.fits(out)
    plan.read_into(ranges, aligned_buffer(len(data) + 8192), out)
    return torch.from_numpy(out["w"][0]).view(dtype)


def test_half_precision_widens_to_float32_bit_for_bit(tmp_path):
    special = np.array([0x7FC1, 0xFFC0, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x3F80, 0xC2F7], np.uint16)
    bits = torch.from_numpy(special.view(np.int16))
    for src_dtype, how in ((torch.bfloat16, BF16_F32), (torch.float16, F16_F32)):
        src = torch.cat([bits.view(src_dtype), torch.randn(4099).to(src_dtype)])  # NaN payloads, inf, -0, tiny
        got = _file_plan(tmp_path, src, how, torch.float32)
        want = src.float()
        nan = torch.isnan(want)
        assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), src_dtype
        assert torch.isnan(got[nan]).all()
        if src_dtype == torch.bfloat16:  # a bfloat16 widens by its bits: NaN payloads kept, as torch keeps them
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    same = torch.randn(777)
    assert torch.equal(_file_plan(tmp_path, same, COPY, torch.float32), same)


def test_packed_copies_land_as_the_copy_path_writes_them(tmp_path):
    g = torch.Generator().manual_seed(0)
    H, I = 64, 96
    shapes = {"gate_up": (2 * I, H), "down": (H, I), "gate_up_bias": (2 * I,), "down_bias": (H,)}
    specs = (QuantSpec(4, 32), QuantSpec(2, 16))
    items = []
    for e in range(3):
        w = ExpertWeights(*(torch.randn(*s, generator=g) for s in shapes.values()))
        items += [(0, e, s, pack_expert(w, s)) for s in specs]
    write_packed(tmp_path / "p.bin", iter(items))
    f = PackedFile.open(tmp_path / "p.bin")
    copied = PackedSlots(shapes, (None, *specs), torch.float32, n_slots=len(items), n_scratch=1, device="cpu")
    direct = PackedSlots(shapes, (None, *specs), torch.float32, n_slots=len(items), n_scratch=1, device="cpu")
    for slot, (m, e, s, _) in enumerate(items):
        copied.write(slot, f.read(m, e, s), s, non_blocking=False)
        assert f.read_into(m, e, s, direct.regions(slot, s))
        direct.filled(slot, s)
        used = copied._layouts[s]["bytes"]
        assert torch.equal(direct.pool[slot, :used], copied.pool[slot, :used]), (e, s)
        assert torch.equal(direct.weights(slot).gate_up, copied.weights(slot).gate_up)
    assert not f.read_into(0, 0, specs[0], direct.regions(0, specs[1]))  # another precision's segments: refused


def test_a_transposed_layout_keeps_the_conversion_path_and_says_so(tmp_path, tiny_models):
    for family, planned in (("gpt_oss", False), ("qwen2_moe", True)):
        model = tiny_models(family, seed=1)  # gpt_oss: fused [E, ...] tensors, transposed; qwen2_moe: per expert
        model.save_pretrained(tmp_path / family)
        a = adapt(model)
        store = DiskStore.open(a, tmp_path / family)
        store.plan()
        assert (store.no_plan == {}) == planned, (family, store.no_plan)
        if not planned:
            assert "read through transformers' conversion" in store.describe()
            assert "separate runs of the file" in next(iter(store.no_plan.values()))
        w = a.expert(1, 2)
        got = _regions(w)
        if store.read_into(1, 2, None, got):
            assert all(bytes(got[n][0]) == bytes(tensor_bytes(t.contiguous())) for n, t in w.tensors().items())
        assert expert_digest(store.fetch(1, 2)) == expert_digest(w)


@pytest.mark.parametrize("name", embedded_models())
def test_direct_reads_keep_the_plain_tokens_and_go_straight_into_the_slots(name, monkeypatch):
    from helpers import greedy, prompt_ids

    from fate_lab.core.config import OffloadConfig
    from fate_lab.offloading.runtime import offload

    model, _ = load_model(name)
    ids = prompt_ids(model.config.vocab_size)
    ref = greedy(model, ids, 6)[0]
    direct = []
    plain_read = DiskStore.read_into

    def counted(self, m, e, spec, regions):
        ok = plain_read(self, m, e, spec, regions)
        direct.append(ok)
        return ok

    monkeypatch.setattr(DiskStore, "read_into", counted)
    for preset in ("load_on_demand", "lru", "fate"):
        over = dict(link="disk", store="ssd", checkpoint=str(model_dir(name)), slots=8)
        with offload(model, OffloadConfig.preset(preset, direct_reads=True, **over)):
            assert torch.equal(greedy(model, ids, 6)[0], ref), preset
        assert direct and all(direct), preset  # every read went straight into its slot
        direct.clear()
        with offload(model, OffloadConfig.preset(preset, **over)):  # the default: the conversion path
            assert torch.equal(greedy(model, ids, 6)[0], ref), preset
        assert not direct, preset
