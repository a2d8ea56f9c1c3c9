"""The timing helpers measure what the simulator predicts: every measured run starts with an empty cache.

The reference is the timed simulator on an instant link, whose counters equal the runtime's exactly
(tests/sim/test_parity.py) and which starts every run cold. A warm-up inside the measured runtime would
leave the prompt's experts cached, and the measured prefill would hit where the simulated one misses.
"""
import pytest
import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.profiles import COMPUTE_PROFILES
from fate_lab.hardware.setups import Hardware
from fate_lab.model.adapters import adapt
from fate_lab.model.record import record_trace
from fate_lab.sim.simulate import simulate
from fate_lab.study import bench


@pytest.mark.parametrize("preset", ["lru", "fate"])
def test_every_repeat_of_run_preset_starts_with_an_empty_cache(preset, embedded_model):
    model, tok = embedded_model("tiny_moe")
    a = adapt(model)
    prompt = tok("The expert cache holds the experts of every layer, and the link")["input_ids"]
    cfg = OffloadConfig.preset(preset, link="instant", slots=a.num_moe_layers * a.num_experts // 2)
    run = bench.run_preset(model, torch.tensor([prompt]), cfg, 4, repeats=2)
    trace = record_trace(model, None, [prompt], decode_tokens=3, progress=False)
    sim = simulate(trace, cfg, Hardware(COMPUTE_PROFILES["qwen15_moe_rtx3090"], None), ModelShape.from_adapter(a))
    want = sim.summary()
    assert run["row"]["prefill hit rate"] == pytest.approx(want["prefill"]["hit_rate"])
    assert run["row"]["decode hit rate"] == pytest.approx(want["decode"]["hit_rate"])
