"""`whatif.machine_hardware` calibrates once per (model, link, quant): a quantized preset is predicted from a
profile measured with its experts packed, never from the full-precision one (the calibration itself is stubbed
here; the benchmark `bench_disk` measures what the difference is worth)."""
from __future__ import annotations

import pytest
import torch

from fate_lab.hardware.compute import ComputeProfile
from fate_lab.study import clock, whatif


def test_calibrated_once_per_link_and_quant(monkeypatch):
    calls = []

    def fake_calibrate(model, ids, link=None, layer_compute_s=None, link_profile=None, quant=None):
        calls.append(quant)
        return ComputeProfile(f"stub quant={quant}", 1e-3, 0.0, 1e-4, 0.0, 0.0, 0.0)

    monkeypatch.setattr(whatif, "calibrate_compute", fake_calibrate)
    monkeypatch.setattr(whatif, "calibration_ids", lambda tok: torch.zeros(1, 4, dtype=torch.long))
    monkeypatch.setattr(clock, "machine_clock", lambda model: type("C", (), {"layer_s": 1e-3})())
    model = torch.nn.Linear(1, 1)
    full, _ = whatif.machine_hardware(model, None, "instant")
    packed, _ = whatif.machine_hardware(model, None, "instant", quant="fate")
    assert calls == [None, "fate"]
    assert full.compute.name == "stub quant=None" and packed.compute.name == "stub quant=fate"
    assert whatif.machine_hardware(model, None, "instant", quant="fate")[0] is packed  # kept, not measured again
    assert whatif.machine_hardware(model, None, "instant")[0] is full
    assert calls == [None, "fate"]
    whatif.machine_hardware(model, None, "instant", fresh=True, quant="fate")
    assert calls == [None, "fate", "fate"]


def test_each_config_predicted_from_the_hardware_of_its_precision(monkeypatch):
    from fate_lab.core.config import OffloadConfig

    full, packed = object(), object()  # stand-ins: only which one each config gets is checked here
    configs = {"lru": OffloadConfig.preset("lru"), "lru_quant": OffloadConfig.preset("lru_quant"),
               "fate_quant": OffloadConfig.preset("fate_quant")}
    got = {}

    def fake_row(trace, config, hardware, shape, name):
        got[name] = hardware
        return {"config": name}

    monkeypatch.setattr(whatif, "sim_row", fake_row)
    whatif.sim_table(None, configs, {None: full, "fate": packed}, None)
    assert got == {"lru": full, "lru_quant": packed, "fate_quant": packed}
    whatif.sim_table(None, configs, full, None)  # one Hardware: every config gets it, as before
    assert set(map(id, got.values())) == {id(full)}
    with pytest.raises(ValueError, match=r"quant='fate'.*machine_hardware"):  # never the full-precision one silently
        whatif.sim_table(None, configs, {None: full}, None)
