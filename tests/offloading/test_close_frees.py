"""A closed runtime that is still referenced (as `fit/calibrate.py` keeps one to read its figures) holds no slot
memory: nothing keeps the device slots alive once `close()` returned."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.model.testing import tiny_model
from fate_lab.offloading.runtime import offload


@pytest.mark.parametrize("link", ["instant", "pcie4_x16"])
def test_a_closed_runtime_kept_referenced_frees_its_slots(link):
    model = tiny_model("mixtral")
    with offload(model, OffloadConfig.preset("lru", all_resident=True, link=link)) as rt:
        refs = [weakref.ref(t) for t in rt.slots.tensors()]
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))
    gc.collect()
    assert rt.engine is not None  # still referenced, and so is its engine
    assert all(r() is None for r in refs), "a slot tensor outlived its closed runtime"
