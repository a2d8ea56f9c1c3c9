"""The compute profile's CPU-emulation costs in the timed simulator, checked by hand arithmetic.

`busy_factor` slows the expert, prediction and call pieces only while the link copies (so a run that
moves nothing is predicted at the resident speed); `transfer_host_s` is charged once per queued
transfer; `landed_s` once per landed transfer and once per host-computed expert. On an instant link a
transfer takes no time, so each of these shifts a run's total by exactly count x cost.
"""
import dataclasses

import pytest

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.links import LinkProfile
from fate_lab.hardware.profiles import COMPUTE_PROFILES
from fate_lab.hardware.setups import Hardware
from fate_lab.model.adapters import adapt
from fate_lab.model.record import record_trace
from fate_lab.sim.simulate import simulate

BASE = COMPUTE_PROFILES["qwen15_moe_rtx3090"]


@pytest.fixture(scope="module")
def setup(embedded_model):
    model, tok = embedded_model("tiny_moe")
    prompts = [tok("The expert cache holds the experts of every layer")["input_ids"],
               tok("In the beginning")["input_ids"]]
    trace = record_trace(model, None, prompts, decode_tokens=7, progress=False)
    shape = ModelShape.from_adapter(adapt(model))
    return trace, shape


def _total(stats) -> float:
    return sum(sum(v) for v in stats.forward_s.values())


def _slow_link(shape: ModelShape) -> LinkProfile:
    return LinkProfile("one expert = 1 ms", shape.nbytes(None) / 1e-3, 0.0)


def test_a_busy_link_slows_nothing_when_nothing_moves(setup):
    trace, shape = setup
    cfg = OffloadConfig.preset("all_resident")
    link = _slow_link(shape)
    idle = simulate(trace, cfg, Hardware(BASE, link), shape)
    busy = simulate(trace, cfg, Hardware(dataclasses.replace(BASE, busy_factor=4.0), link), shape)
    assert sum(layer["decode"].bytes_moved for layer in busy.layers) == 0
    assert _total(busy) == pytest.approx(_total(idle), rel=1e-12)


def test_a_busy_link_slows_the_compute_pieces_that_overlap_its_copies(setup):
    trace, shape = setup  # load-on-demand: no decision depends on timing, so slower pieces can only add time
    cfg = OffloadConfig.preset("load_on_demand")
    link = LinkProfile("one expert = one expert's compute", shape.nbytes(None) / BASE.expert_s, 0.0)
    base = simulate(trace, cfg, Hardware(BASE, link), shape)
    slow = simulate(trace, cfg, Hardware(dataclasses.replace(BASE, busy_factor=4.0), link), shape)
    assert _total(slow) > _total(base)
    # at most every expert, call and prediction piece 4x as long: the dense layers are untouched
    calls = sum(layer[p].compute_s - layer[p].stall_s for layer in base.layers for p in ("prefill", "decode"))
    assert _total(slow) - _total(base) <= 3 * calls + 1e-9
    instant = [simulate(trace, OffloadConfig.preset("fate", slots=64), Hardware(c, None), shape)
               for c in (BASE, dataclasses.replace(BASE, busy_factor=4.0))]
    assert _total(instant[1]) == pytest.approx(_total(instant[0]), rel=1e-12)  # an instant link is never busy


def test_each_queued_transfer_costs_the_compute_thread_transfer_host_s(setup):
    trace, shape = setup
    cfg = OffloadConfig.preset("fate", slots=shape.num_moe_layers * shape.num_experts // 4)
    cost = 37e-6
    base = simulate(trace, cfg, Hardware(BASE, None), shape)
    charged = simulate(trace, cfg, Hardware(dataclasses.replace(BASE, transfer_host_s=cost), None), shape)
    moved = sum(layer[p].bytes_moved for layer in base.layers for p in ("prefill", "decode")) // shape.nbytes(None)
    assert moved > 0
    assert _total(charged) - _total(base) == pytest.approx(moved * cost, rel=1e-9)


def test_a_host_computed_expert_costs_the_dense_layers_landed_s(setup):
    trace, shape = setup
    cfg = OffloadConfig.preset("all_host")
    cost = 1e-6  # 32 experts x 1 us stays below one dense layer (0.36 ms): no cap
    base = simulate(trace, cfg, Hardware(BASE, None), shape)
    charged = simulate(trace, cfg, Hardware(dataclasses.replace(BASE, landed_s=cost), None), shape)
    assert sum(layer[p].host for layer in base.layers for p in ("prefill", "decode")) > 0
    # one charge per host computation: each (forward, layer, expert) once, however many tokens it serves
    assert _total(charged) - _total(base) == pytest.approx(_host_computations(trace, shape) * cost, rel=1e-9)


def test_what_evicts_a_dense_layer_costs_it_at_most_its_own_time_again(setup):
    trace, shape = setup
    cfg = OffloadConfig.preset("all_host")  # every MoE layer of every forward computes on the host
    base = simulate(trace, cfg, Hardware(BASE, None), shape)
    capped = simulate(trace, cfg, Hardware(dataclasses.replace(BASE, landed_s=1.0), None), shape)
    from fate_lab.sim.simulate import trace_steps

    # each MoE layer's evictions are paid once, by the next dense layer (the last one's at the forward's end)
    want = sum(shape.num_moe_layers * BASE.dense(b - a) for a, b in trace_steps(trace))
    assert _total(capped) - _total(base) == pytest.approx(want, rel=1e-9)


def _host_computations(trace, shape) -> int:
    """Distinct (forward, layer, expert) of the trace: a prefill's rows are one forward, each decode row one."""
    from fate_lab.sim.simulate import trace_steps

    return sum(len(set(trace.experts[a:b, m].reshape(-1).tolist())) for a, b in trace_steps(trace)
               for m in range(shape.num_moe_layers))


def test_a_busy_factor_below_one_is_refused():
    with pytest.raises(ValueError, match="busy_factor=0.5"):
        ComputeProfile("bad", 1e-3, 0.0, 1e-4, 0.0, 0.0, 0.0, busy_factor=0.5)


@pytest.mark.parametrize("quant", ["int4", "fate", None])
def test_a_packed_slot_pays_its_dequantize_at_every_compute(setup, quant):
    trace, shape = setup  # every expert resident over an instant link: each compute is from a slot, none moves
    cfg = OffloadConfig.preset("all_resident", quant=quant)
    hw = Hardware(BASE, LinkProfile("instant", 1e30, 0.0))
    base = simulate(trace, cfg, hw, shape)
    dq = simulate(trace, cfg, dataclasses.replace(hw, compute=dataclasses.replace(BASE, dequant_s=1e-3)), shape)
    computes = sum(layer[p].uses for layer in dq.layers for p in ("prefill", "decode"))
    packed = quant is not None  # int4 and fate keep the cache at INT4; no quant: full-precision slots
    assert _total(dq) - _total(base) == pytest.approx(1e-3 * computes if packed else 0.0, rel=1e-9, abs=1e-12)


def test_a_predictor_measured_apart_is_charged_its_own_host_time(setup):
    trace, shape = setup  # an instant link: the predictions' times only add up
    cfg = OffloadConfig.preset("activation_path", slots=shape.num_moe_layers * shape.num_experts // 4)
    own = dataclasses.replace(BASE, predictors=(("activation_path", BASE.predict_s + 1e-3, 2e-5),))
    base = simulate(trace, cfg, Hardware(BASE, None), shape)
    charged = simulate(trace, cfg, Hardware(own, None), shape)
    # every layer but the last predicts once per forward: 1 ms more each, and 2e-5 - the gate's slope per token
    # beyond the first of a prefill (prompt lengths from the trace)
    M = shape.num_moe_layers
    steps = [(b - a) for a, b in _steps(trace)]
    extra = sum((M - 1) * (1e-3 + (2e-5 - BASE.predict_per_token_s) * (T - 1)) for T in steps)
    assert _total(charged) - _total(base) == pytest.approx(extra, rel=1e-9)
    other = dataclasses.replace(BASE, predictors=(("activation_matrix", 1.0, 0.0),))  # not this config's predictor
    assert _total(simulate(trace, cfg, Hardware(other, None), shape)) == pytest.approx(_total(base), rel=1e-12)


def _steps(trace):
    from fate_lab.sim.simulate import trace_steps

    return trace_steps(trace)


@pytest.mark.parametrize("row", [("activation_path", -1.0, 0.0), ("activation_path", 1e-3), (1, 1e-3, 0.0)])
def test_a_predictor_row_that_cannot_hold_is_refused(row):
    with pytest.raises(ValueError, match="predictors holds"):
        dataclasses.replace(BASE, predictors=(row,))


def test_a_prefill_step_charges_the_prefill_intercepts_and_a_decode_step_does_not(setup):
    trace, shape = setup  # all resident on an instant link: every piece's time just adds up
    cfg = OffloadConfig.preset("all_resident")
    d = 1e-3
    own = dataclasses.replace(BASE, dense_prefill_s=BASE.dense_s + d, call_prefill_s=BASE.call_s + 2 * d,
                              call_per_token_s=1e-5)
    base = simulate(trace, cfg, Hardware(BASE, None), shape)
    charged = simulate(trace, cfg, Hardware(own, None), shape)
    assert charged.forward_s["decode"] == pytest.approx(base.forward_s["decode"], rel=1e-12)
    M, L = shape.num_moe_layers, shape.num_layers
    for T, b, c in zip([b - a for a, b in _steps(trace) if b - a > 1], base.forward_s["prefill"],
                       charged.forward_s["prefill"], strict=True):
        assert c - b == pytest.approx(L * d + M * (2 * d + 1e-5 * (T - 1)), rel=1e-9)


def test_the_prefill_lines_go_through_a_short_and_a_long_prefill_by_hand():
    from fate_lab.fit.calibrate import _prefill_lines

    # per layer: dense 1 ms at 16 tokens, 2.12 ms at 128 (0.01 ms per token: 0.85 ms at 1 token); an expert 0.08 ms
    # at 2 tokens each, 0.18 ms at 12 (0.01 per token: 0.07 ms at 1); the call's own 0.2 and 0.312 ms (0.001 per
    # token: 0.185 ms); a prediction 0.5 and 1.62 ms (0.01 per token: 0.35 ms)
    short, long = [1e-3, 0.08e-3, 2.0, 0.2e-3, 0.5e-3], [2.12e-3, 0.18e-3, 12.0, 0.312e-3, 1.62e-3]
    prefill, slopes = _prefill_lines(short, long, 16, 128)
    assert prefill == pytest.approx({"dense_prefill_s": 0.85e-3, "expert_prefill_s": 0.07e-3,
                                     "call_prefill_s": 0.185e-3, "call_per_token_s": 1e-6,
                                     "predict_prefill_s": 0.35e-3})
    assert slopes == pytest.approx((1e-5, 1e-5, 1e-5))
    profile = dataclasses.replace(BASE, **prefill, dense_per_token_s=slopes[0], expert_per_token_s=slopes[1],
                                  predict_per_token_s=slopes[2])
    assert profile.dense(16) == pytest.approx(1e-3) and profile.dense(128) == pytest.approx(2.12e-3)
    assert profile.expert(12, T=128) == pytest.approx(0.18e-3) and profile.call(128) == pytest.approx(0.312e-3)
    assert profile.expert(1) == BASE.expert_s and profile.dense(1) == BASE.dense_s  # a decode step: its own figures
    # a piece that shrinks with length is held flat, never negative
    flat, _ = _prefill_lines([1e-3, 0.1e-3, 2.0, 0.2e-3, 0.5e-3], [0.5e-3, 0.1e-3, 12.0, 0.1e-3, 0.5e-3], 16, 128)
    assert flat["dense_prefill_s"] == pytest.approx(1e-3) and flat["call_per_token_s"] == 0.0


def test_a_busy_link_never_slows_a_host_computed_expert(setup):
    trace, shape = setup  # host compute beside a copying link: busy_factor is the device's slow-down, not the host's
    cfg = OffloadConfig.preset("host_compute", slots=shape.num_moe_layers * shape.num_experts // 4)
    link = _slow_link(shape)
    base = simulate(trace, cfg, Hardware(BASE, link), shape)
    busy = simulate(trace, cfg, Hardware(dataclasses.replace(BASE, busy_factor=4.0), link), shape)
    # the cost-based placement may send other experts to the host once the device is slower; a decode step's host
    # computation serves one token, so each takes the host's own time for one token either way
    per = [sum(layer["decode"].host_s for layer in s.layers) / sum(layer["decode"].host for layer in s.layers)
           for s in (base, busy)]
    assert per[0] > 0 and per[1] == pytest.approx(per[0], rel=1e-9)


def test_a_predictor_row_with_a_prefill_intercept_charges_it_in_prefill_steps_only(setup):
    trace, shape = setup  # an instant link: the predictions' times only add up
    cfg = OffloadConfig.preset("activation_path", slots=shape.num_moe_layers * shape.num_experts // 4)
    flat = dataclasses.replace(BASE, predictors=(("activation_path", 1e-3, 2e-5),))
    prefill = dataclasses.replace(BASE, predictors=(("activation_path", 1e-3, 2e-5, 4e-3),))
    M = shape.num_moe_layers
    prefills = sum(1 for a, b in _steps(trace) if b - a > 1)  # a decode step is one token
    extra = prefills * (M - 1) * 3e-3  # each prefill's every prediction: 4 ms at 1 token instead of 1 ms
    gap = _total(simulate(trace, cfg, Hardware(prefill, None), shape)) - _total(
        simulate(trace, cfg, Hardware(flat, None), shape))
    assert prefills > 0 and gap == pytest.approx(extra, rel=1e-9)


def test_a_predictors_cost_is_read_back_by_inverting_the_simulators_charge():
    from fate_lab.fit.calibrate import _per_prediction

    # hand example: 2 decode steps of 4 MoE layers, the gate preset's bookkeeping 0.5 ms per layer, 6 predictions;
    # the calls spent 10 ms beyond their experts: 10 - 2 x 4 x 0.5 = 6 ms over 6 predictions = 1 ms each
    assert _per_prediction(10e-3, 6, 4, 0.5e-3, steps=2) == pytest.approx(1e-3)
    assert _per_prediction(1e-3, 6, 4, 0.5e-3) == 0.0  # less than the bookkeeping: no negative time
    assert _per_prediction(1e-3, 0, 4, 0.5e-3) == 0.0  # a predictor that made no prediction costs none
