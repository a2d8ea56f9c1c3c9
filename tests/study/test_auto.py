"""The `auto` planner: it decides from the calibration trace it is given, never worse there than any named start,
keeps the request's size and kind (lossless / quantized), and resolves through `offload` with exact tokens."""
import pytest
import torch
from helpers import greedy, prompt_ids

import fate_lab
from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.setups import Hardware
from fate_lab.model.adapters import adapt
from fate_lab.sim.simulate import simulate
from fate_lab.study import lab
from fate_lab.study.auto import LOSSLESS_START, QUANT_START, plan_auto, resolve

SETUP = "qwen15_moe_rtx3090_pcie3"


@pytest.fixture(scope="module")
def calib():
    return lab.get_trace("tiny_moe", fast=True, split="calib")


@pytest.mark.parametrize("request_name,starts", [("auto", LOSSLESS_START), ("auto_quant", QUANT_START)])
def test_the_pick_is_the_calibration_best_and_keeps_the_requests_size_and_kind(request_name, starts, calib,
                                                                                embedded_model):
    model, _ = embedded_model("tiny_moe")
    shape = ModelShape.from_adapter(adapt(model))
    hw = Hardware.scaled(SETUP)
    plan = plan_auto(calib, shape, hw, OffloadConfig.preset(request_name, slots=64), rounds=1)
    c = plan.config
    assert (c.name, c.slots, c.auto) == (request_name, 64, None)
    assert (c.quant is not None) == (request_name == "auto_quant") and c.lossy.kind is None
    named = {name: simulate(calib, OffloadConfig.preset(name, slots=64), hw, shape).decode_tok_s for name in starts}
    assert plan.scores[0][1] == simulate(calib, c, hw, shape).decode_tok_s >= max(named.values())
    assert plan.frame()["vs pick"].max() == 1.0 and plan.describe().startswith(plan.scores[0][0])


def test_a_plan_request_is_refused_where_no_planner_can_calibrate():
    with pytest.raises(ValueError, match="plan_auto"):
        plan_auto(None, None, None, OffloadConfig.preset("fate"))
    with pytest.raises(ValueError, match="compute profile"):
        resolve(OffloadConfig.preset("auto"), ModelShape(1, 1, 4, 1, 8, 8, torch.float32, 0, 0), Hardware(None, None))
    with pytest.raises(ValueError, match="names no model folder"):
        fate_lab.simulate(None, OffloadConfig.preset("auto"), Hardware.scaled(SETUP),
                          ModelShape(1, 1, 4, 1, 8, 8, torch.float32, 0, 0))


def test_the_drivers_refuse_a_plan_request_and_name_the_calls_that_plan_it(embedded_model, calib):
    # the planner is called explicitly by fate_lab.offload / fate_lab.simulate; below them a request is refused
    from fate_lab.core.driver import DriverCore
    from fate_lab.offloading.runtime import offload

    model, _ = embedded_model("tiny_moe")
    shape = ModelShape.from_adapter(adapt(model))
    for call in (lambda: offload(model, OffloadConfig.preset("auto", slots=8)),
                 lambda: simulate(calib, OffloadConfig.preset("auto_quant", slots=8), Hardware.scaled(SETUP), shape),
                 lambda: DriverCore(OffloadConfig.preset("auto"), shape, Hardware.scaled(SETUP), driver="replay")):
        with pytest.raises(ValueError, match=r"is a plan request .* call fate_lab.offload\(model, config\) or "
                                             r"fate_lab.simulate"):
            call()


@pytest.mark.slow
def test_offload_resolves_auto_with_a_short_calibration_and_keeps_the_tokens(embedded_model):
    from fate_lab import offload

    model, _ = embedded_model("tiny_moe")
    ids = prompt_ids(model.config.vocab_size)
    ref, _ = greedy(model, ids, 8)
    cfg = OffloadConfig.preset("auto", slots=64, link=SETUP, layer_compute_s=1e-3)
    with offload(model, cfg) as rt:
        assert rt.config.auto is None and rt.config.name == "auto" and rt.config.quant is None
        out, _ = greedy(model, ids, 8)
    assert torch.equal(out, ref)
