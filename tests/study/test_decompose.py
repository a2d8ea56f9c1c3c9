"""The decomposition: its factors multiply to the total, and its counterfactual predictors are what they claim."""
import math

import pandas as pd
import pytest
import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.links import LinkProfile
from fate_lab.hardware.profiles import COMPUTE_PROFILES
from fate_lab.hardware.setups import Hardware
from fate_lab.model.trace import from_routing_array
from fate_lab.policy.predictors import ActivationPath, Oracle
from fate_lab.sim.simulate import simulate
from fate_lab.study.decompose import Filtered, by_regime, eap_margins, factors, ratio_hardware, versus_eap


def test_factors_multiply_to_the_total_speed_up():
    speed = {"load_on_demand": 10.0, "cache": 20.0, "allocation": 18.0, "replacement": 19.0, "free": 60.0,
             "oracle": 30.0, "filtered": 27.0, "prediction": 25.0, "quantization": 50.0, "host compute": 40.0}
    fp = factors(speed, "fp")
    assert fp["prediction: ceiling"] == 60 / 19 and fp["prediction: lateness"] == 0.5
    assert math.prod(fp.values()) == pytest.approx(40.0 / 10.0) and "quantization" not in fp
    assert math.prod(factors(speed, "int4/int2").values()) == pytest.approx(50.0 / 10.0)


def _trace():
    g = torch.Generator().manual_seed(0)
    ex = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(40 * 3)]).reshape(40, 3, 2)  # (N, L, k)
    return from_routing_array(ex, num_experts=8, phase=[0] * 4 + [1] * 36)


def test_the_oracle_and_the_filtered_predictor_in_the_simulator():
    tr = _trace()
    shape = ModelShape(3, 3, 8, 2, 16, 16, torch.float32, 0, 0)
    hw = Hardware(COMPUTE_PROFILES["qwen15_moe_rtx3090"], LinkProfile("hand", 1e9, 0.0))
    cfg = OffloadConfig.preset("activation_path", slots=6)
    oracle = simulate(tr, cfg, hw, shape, predictor=Oracle(tr.experts)).total("decode")
    assert (oracle.recall, oracle.precision) == (1.0, 1.0)
    plain = simulate(tr, cfg, hw, shape).total("decode")
    filt = simulate(tr, cfg, hw, shape, predictor=Filtered(ActivationPath(), tr.experts)).total("decode")
    assert filt.precision == 1.0 and filt.predicted_used == plain.predicted_used  # the same correct guesses
    assert filt.predicted < plain.predicted


def test_a_ratio_link_moves_one_expert_in_ratio_layer_computes():
    shape = ModelShape(3, 3, 8, 2, 16, 16, torch.float32, 0, 0)
    comp = COMPUTE_PROFILES["qwen15_moe_rtx3090"]
    hw = ratio_hardware(shape, comp, 2.0)
    assert hw.link.transfer_time(shape.nbytes(None)) == pytest.approx(2.0 * comp.decode_layer_s(2))
    fp16 = 3 * 16 * 16 * 2  # quantized experts keep the fp16 expert's clock
    assert (ratio_hardware(shape, comp, 2.0, "fate").link.transfer_time(fp16)
            == pytest.approx(2 * comp.decode_layer_s(2)))


def _long(speeds: dict) -> pd.DataFrame:
    """decompose's long rows from hand speeds per regime (ratio, share)."""
    rows = []
    for (r, share), speed in speeds.items():
        for precision in ("fp", "int4/int2"):
            f = factors(speed, precision)
            rows += [{"model": "m", "ratio": r, "cached": share, "precision": precision, "component": c, "factor": x,
                      "total speed-up": math.prod(f.values())} for c, x in f.items()]
    return pd.DataFrame(rows)


def test_by_regime_merges_the_prediction_parts_and_both_precisions():
    a = {"load_on_demand": 10.0, "cache": 20.0, "allocation": 18.0, "replacement": 19.0, "free": 60.0,
         "oracle": 30.0, "filtered": 27.0, "prediction": 25.0, "quantization": 50.0, "host compute": 40.0}
    b = dict(a, cache=15.0, prediction=38.0, quantization=76.0)
    t = by_regime(_long({(2.0, 0.25): a, (0.5, 0.5): b})).set_index(["ratio", "cached"])
    assert len(t) == 2 and t.loc[(2.0, 0.25), "prediction"] == pytest.approx(25 / 19)  # the four parts together
    row = t.loc[(0.5, 0.5)]
    assert (row["cache"], row["prediction"]) == (pytest.approx(1.5), pytest.approx(38 / 19))
    assert row["host compute"] == pytest.approx(40 / 38) and row["quantization"] == pytest.approx(2.0)
    assert (row["total (fp)"], row["total (int4/int2)"]) == (pytest.approx(4.0), pytest.approx(7.6))
    steps = row["cache"] * row["allocation"] * row["replacement"] * row["prediction"]
    assert steps * row["host compute"] == pytest.approx(row["total (fp)"])
    assert steps * row["quantization"] == pytest.approx(row["total (int4/int2)"])


def test_eap_margins_by_hand():
    vs = pd.DataFrame({"ratio": [0.5, 2.0, 2.0, 4.0], "cached": [0.25, 0.1, 0.5, 0.25],
                       "fate / best EAP": [1.1, 0.9, 1.3, 1.0], "fate_quant / eap": [1.5, 4.0, 2.0, 3.0],
                       "fate_quant / eap_quant": [1.0, 1.05, 0.95, 1.02]})
    m = eap_margins(vs)
    same = m.loc["fate / best EAP (same precision)"]
    assert (same["smallest"], same["largest"], same["largest at"], same["regimes"]) == (0.9, 1.3, "r=2, 50% cached", 4)
    slow = m.loc["fate_quant / eap, r >= 1 and <= 25% cached"]  # r=2 at 10% and r=4 at 25% only
    assert (slow["smallest"], slow["largest"], slow["regimes"]) == (3.0, 4.0, 2)
    none = eap_margins(vs[vs["ratio"] < 1]).loc["fate_quant / eap, r >= 1 and <= 25% cached"]
    assert math.isnan(none["smallest"]) and none["largest at"] == "—" and none["regimes"] == 0


def test_versus_eap_against_the_simulator_run_by_hand():
    from helpers import prompt_ids

    from fate_lab.model.adapters import adapt
    from fate_lab.model.record import record_trace
    from fate_lab.model.testing import tiny_model

    model = tiny_model("qwen2_moe", seed=3, moe_intermediate_size=64)  # INT4/INT2 groups of 64 fit its experts
    prompts = [prompt_ids(model.config.vocab_size, n=10, seed=s)[0].tolist() for s in range(3)]
    trace = record_trace(model, None, prompts, decode_tokens=8, progress=False)
    shape = ModelShape.from_adapter(adapt(model))
    calib, ev = trace.subset(trace.prompt_id == 0), trace.subset(trace.prompt_id > 0)
    comp = COMPUTE_PROFILES["qwen15_moe_rtx3090"]
    vs = versus_eap(ev, shape, ratios=(4.0,), shares=(0.25,), calibration=calib)
    row = vs.iloc[0]
    slots = int(shape.num_moe_layers * shape.num_experts * 0.25)
    hw, hwq = ratio_hardware(shape, comp, 4.0), ratio_hardware(shape, comp, 4.0, "fate")
    eap = OffloadConfig.preset("eap", slots=slots)
    speed = {"eap": simulate(ev, eap, hw, shape).decode_tok_s,
             "eap_quant": simulate(ev, eap.replace(quant="fate"), hwq, shape).decode_tok_s,
             "fate_quant": simulate(ev, OffloadConfig.preset("fate_quant", slots=slots), hwq, shape).decode_tok_s}
    assert row["eap tok/s"] == pytest.approx(speed["eap"])
    assert row["eap_quant tok/s"] == pytest.approx(speed["eap_quant"])
    assert row["fate_quant / eap"] == pytest.approx(speed["fate_quant"] / speed["eap"])
    assert row["eap_quant tok/s"] > row["eap tok/s"]  # a slow link: fewer bytes per expert must pay
    best = max(row["activation_path tok/s"], row["eap tok/s"], row["eap (profiled) tok/s"])
    assert row["fate / best EAP"] == pytest.approx(row["fate tok/s"] / best)
    assert "eap (profiled) tok/s" not in versus_eap(ev, shape, ratios=(4.0,), shares=(0.25,)).columns
