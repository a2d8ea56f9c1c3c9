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

    def fake_calibrate(model, ids, link=None, layer_compute_s=None, link_profile=None, quant=None, quick=False):
        calls.append(quant if not quick else f"{quant} quick")
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
    # FAST mode's quick calibration reuses a full one; a quick one is never reused for a full one
    assert whatif.machine_hardware(model, None, "instant", quick=True)[0] is full
    other = torch.nn.Linear(1, 1)
    rough, _ = whatif.machine_hardware(other, None, "instant", quick=True)
    assert whatif.machine_hardware(other, None, "instant", quick=True)[0] is rough
    assert whatif.machine_hardware(other, None, "instant")[0] is not rough
    assert calls == [None, "fate", "fate", "None quick", None]


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


def test_side_by_side_predicts_a_quantized_config_from_its_own_calibration(monkeypatch):
    import pandas as pd

    from fate_lab.core.config import OffloadConfig
    from fate_lab.model import record
    from fate_lab.sim import simulate
    from fate_lab.study import beyond

    calibrated, used = [], {}

    def fake_hardware(model, tok, link, fresh=False, quant=None):
        calibrated.append(quant)
        return f"hw {quant}", 1e-3

    class Result:
        decode_tok_s = 1.0

        def hit_rate(self, phase):
            return 0.5

    def fake_simulate(trace, cfg, hw, shape):
        used[cfg.name] = hw
        return Result()

    monkeypatch.setattr(whatif, "machine_hardware", fake_hardware)
    monkeypatch.setattr(simulate, "simulate", fake_simulate)
    monkeypatch.setattr(record, "record_trace", lambda *a, **k: None)
    monkeypatch.setattr(beyond, "_greedy_ids", lambda model, ids, n: [0] * n)
    monkeypatch.setattr(beyond, "runtime_row", lambda *a, **k: {"decode tok/s": 1.0, "same tokens as plain": True})
    import fate_lab.core.shape as shape_mod
    import fate_lab.model.adapters as adapters

    monkeypatch.setattr(adapters, "adapt", lambda model: None)
    monkeypatch.setattr(shape_mod.ModelShape, "from_adapter", staticmethod(lambda a: None))
    tok = lambda text: {"input_ids": [1, 2, 3]}  # noqa: E731
    configs = {n: OffloadConfig.preset(n) for n in ("lru", "lru_quant", "fate_quant", "fate")}
    df = beyond.side_by_side(None, tok, ["a prompt"], configs, link="instant")
    assert isinstance(df, pd.DataFrame) and len(df) == 4
    assert calibrated == [None, "fate"]  # the packed calibration made once, for both quantized configs
    assert used == {"lru": "hw None", "lru_quant": "hw fate", "fate_quant": "hw fate", "fate": "hw None"}
