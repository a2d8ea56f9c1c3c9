"""Packed copies written to a file once: each read back with O_DIRECT equals the copy packed in memory, a changed
byte is refused, and an index of another format or length is not trusted."""
from __future__ import annotations

import json

import pytest
import torch

from fate_lab.model.experts import ExpertWeights
from fate_lab.offloading.packed_file import PackedFile, packed_dir, write_packed
from fate_lab.offloading.store import CheckpointError
from fate_lab.quant.experts import pack_expert
from fate_lab.quant.kernels import QuantSpec

SPECS = (QuantSpec(4, 32), QuantSpec(2, 16))


def _expert(seed: int, bias: bool) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    H, I = 64, 96
    biases = (torch.randn(2 * I, generator=g), torch.randn(H, generator=g)) if bias else (None, None)
    return ExpertWeights(torch.randn(2 * I, H, generator=g), torch.randn(H, I, generator=g), *biases)


def _items():
    return [(m, e, s, pack_expert(_expert(10 * m + e, bias=e == 1), s)) for m in range(2) for e in range(3)
            for s in SPECS]


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, p).packed, getattr(b, p).packed) and torch.equal(getattr(a, p).scale,
               getattr(b, p).scale) and torch.equal(getattr(a, p).zero, getattr(b, p).zero)
               and getattr(a, p).shape == getattr(b, p).shape for p in ("gate_up", "down")) and \
        a.biases().keys() == b.biases().keys() and all(torch.equal(a.biases()[k], b.biases()[k]) for k in a.biases())


def test_every_packed_copy_reads_back_as_it_was_packed(tmp_path):
    items = _items()
    write_packed(tmp_path / "p.bin", iter(items))
    f = PackedFile.open(tmp_path / "p.bin")
    assert f is not None and not list(tmp_path.glob("*.part"))
    for m, e, s, p in items:
        got = f.read(m, e, s)
        assert _same(got, p), (m, e, s)
        assert f.nbytes(m, e, s) >= p.nbytes
        assert torch.equal(got.gate_up.dequantize(), p.gate_up.dequantize())
    assert (tmp_path / "p.bin").stat().st_size % 4096 == 0  # every run starts aligned


def test_a_changed_byte_is_refused_and_a_foreign_index_is_not_trusted(tmp_path):
    items = _items()
    path = tmp_path / "p.bin"
    write_packed(path, iter(items))
    f = PackedFile.open(path)
    r = f.runs[1, 2, SPECS[0]]
    data = bytearray(path.read_bytes())
    data[r["offset"] + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"expert 2 of MoE layer 1 at int4 .* does not match its digest"):
        PackedFile.open(path).read(1, 2, SPECS[0])
    idx = path.with_name("p.bin.json")
    meta = json.loads(idx.read_text())
    idx.write_text(json.dumps({**meta, "format": 0}))
    assert PackedFile.open(path) is None
    idx.write_text(json.dumps(meta))
    path.write_bytes(bytes(data[:-4096]))  # shorter than its index says
    assert PackedFile.open(path) is None
    assert PackedFile.open(tmp_path / "missing.bin") is None


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("FATE_LAB_CACHE", str(tmp_path / "c"))
    assert packed_dir() == tmp_path / "c" / "packed"
    monkeypatch.delenv("FATE_LAB_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert packed_dir() == tmp_path / "x" / "fate_lab" / "packed"
