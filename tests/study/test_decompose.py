"""The decomposition: its factors multiply to the total, and its counterfactual predictors are what they claim."""
import math

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
from fate_lab.study.decompose import Filtered, factors, ratio_hardware


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
    assert ratio_hardware(shape, comp, 2.0, "fate").link.transfer_time(fp16) == pytest.approx(2 * comp.decode_layer_s(2))
