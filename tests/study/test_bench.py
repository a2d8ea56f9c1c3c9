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


def test_paired_ratio_interleaves_the_plain_model_and_the_config_and_averages_the_rounds(monkeypatch):
    """Scripted timings (no clock): each round times plain generate, then the config; the ratio is the mean of
    the per-round ratios, its spread two standard errors of that mean (statistics.stdev as the reference)."""
    import statistics

    plain_rates, config_rates = iter([100.0, 50.0, 80.0, 100.0]), iter([95.0, 51.0, 80.0, 90.0])
    calls = []

    def fake_time_generate(model, ids, new_tokens, repeats=1):
        calls.append("plain" if ids.shape[1] > 8 else "warm-up")
        return bench.GenerateTiming([1, 2], 0.01, next(plain_rates) if ids.shape[1] > 8 else 1.0)

    def fake_run_preset(model, ids, config, new_tokens, repeats=1):
        calls.append(config.name)
        return {"row": {"decode tok/s": next(config_rates)}, "tokens": [1, 2]}

    monkeypatch.setattr(bench, "time_generate", fake_time_generate)
    monkeypatch.setattr(bench, "run_preset", fake_run_preset)
    ratio, spread = bench.paired_ratio(None, torch.zeros(1, 12, dtype=torch.long),
                                       OffloadConfig.preset("all_resident", slots=4), 4, rounds=4)
    per_round = [0.95, 1.02, 1.0, 0.9]
    mean = statistics.mean(per_round)
    assert calls == ["warm-up"] + ["plain", "all_resident"] * 4
    assert ratio == pytest.approx(mean)
    assert spread == pytest.approx(2 * statistics.stdev(per_round) / 2 / mean)  # sqrt(4) = 2
    with pytest.raises(ValueError, match="rounds"):
        bench.paired_ratio(None, torch.zeros(1, 12, dtype=torch.long), OffloadConfig.preset("lru", slots=4), 4, 1)
