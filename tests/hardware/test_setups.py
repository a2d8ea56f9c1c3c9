"""Hardware facts: the one table of setups, the one scaling rule, and the checks on every profile's numbers."""
import math

import pytest
import torch

from fate_lab.core.driver import scaling_bytes
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.hosts import HOST_PROFILES, HostProfile
from fate_lab.hardware.links import LINK_PROFILES, LinkProfile
from fate_lab.hardware.models import expert_bytes
from fate_lab.hardware.profiles import COMPUTE_PROFILES, HAND_PROFILES, compare_profiles
from fate_lab.hardware.setups import SETUPS, Hardware, link_names, resolve_link, run_hardware
from fate_lab.quant import QuantPolicy

QWEN_EXPERT = 3 * 2048 * 1408 * 2  # Qwen1.5-MoE-A2.7B: hidden 2048, expert width 1408, fp16


def test_a_real_expert_size_comes_from_its_published_config():
    assert expert_bytes("Qwen1.5-MoE-A2.7B") == QWEN_EXPERT == SETUPS["qwen15_moe_rtx3090_pcie3"].expert_bytes()
    assert expert_bytes("Mixtral-8x7B") == 3 * 4096 * 14336 * 2  # its expert width is named intermediate_size


def test_a_setup_layer_time_by_the_roofline_by_hand():
    s = SETUPS["qwen15_moe_rtx3090_pcie3"]
    bw = 936.2e9 * 0.75  # RTX 3090 data sheet x the weight-streaming efficiency
    dense = 20 * 5e-6 + (103030954.67 + 622329856 / 24) / bw  # 20 launches + a layer's dense weights + 1/24 head
    expert = 4 * 5e-6 + 17301504 / bw
    # + top-4 experts + the runtime's host time per experts call (78 us measured with lru on a 2.6 GHz core),
    # scaled to the clock of the profile's host CPU, desktop_ddr4 (a Ryzen 9 5950X-class desktop, 3.4 GHz all-core)
    layer = dense + 4 * expert + 78e-6 * 2.6 / 3.4
    assert s.layer_s() == pytest.approx(layer)
    assert s.ratio() == pytest.approx((10e-6 + QWEN_EXPERT / 12e9) / layer)


def test_the_one_scaling_rule_keeps_the_real_ratio_on_any_clock():
    s = SETUPS["qwen15_moe_rtx3090_pcie3"]
    hw = s.on_clock(12_345, layer_s=1e-3)  # a small model whose decode layer takes 1 ms here
    clock = 1e-3 / s.layer_s()
    assert hw.link.transfer_time(12_345) / 1e-3 == pytest.approx(s.ratio())
    assert hw.link.latency == pytest.approx(10e-6 * clock)  # latency and bandwidth stretched by one factor
    assert hw.compute is None and hw.link.scaled_from == s.name
    host = hw.host_time("desktop_ddr4", 12_345, 6.0 * 12_345)  # the real expert is charged, on this clock
    assert host(1) == pytest.approx(clock * HOST_PROFILES["desktop_ddr4"].expert_s(QWEN_EXPERT, QWEN_EXPERT, 1))
    own = s.on_clock(12_345)  # the setup's own clock: its compute profile, the real expert's transfer time
    assert own.compute is COMPUTE_PROFILES["qwen15_moe_rtx3090"]
    assert own.link.transfer_time(12_345) == pytest.approx(LINK_PROFILES["pcie3_x16"].transfer_time(QWEN_EXPERT))


def test_a_scaled_hardware_is_fitted_to_the_model_that_runs():
    scaled = Hardware.scaled("qwen15_moe_rtx3090_pcie4", layer_s=2e-3)
    assert scaled.for_model(4096) == SETUPS["qwen15_moe_rtx3090_pcie4"].on_clock(4096, 2e-3)
    with pytest.raises(ValueError, match="for_model"):
        scaled.transfer_s(4096)
    # a quantized run fits the link to the model's expert at fp16, the precision the real setups move
    shape = ModelShape(2, 2, 8, 2, 64, 32, torch.float32, 0, 0)
    assert scaling_bytes(shape, None) == 3 * 64 * 32 * 4 and scaling_bytes(shape, QuantPolicy.preset("fate")) == \
        3 * 64 * 32 * 2


def test_run_hardware_names_every_link_and_refuses_the_unknown():
    assert run_hardware("instant") == Hardware(None, None)
    assert run_hardware("pcie4_x16").link is LINK_PROFILES["pcie4_x16"]
    assert resolve_link("pcie4_x16") is LINK_PROFILES["pcie4_x16"]
    with pytest.raises(ValueError, match="layer time"):
        run_hardware("qwen15_moe_rtx3090_pcie3")
    with pytest.raises(ValueError, match="unknown link 'pcie9'"):
        run_hardware("pcie9")
    assert set(link_names()) == set(LINK_PROFILES) | set(SETUPS)
    for name in SETUPS:  # every setup resolves: its model, compute profile, link and host exist
        s = SETUPS[name]
        assert s.layer_s() > 0 and math.isfinite(s.ratio()) and s.hardware().link.bandwidth > 0
        s.hardware().host_time(s.host, 1, 1.0)


@pytest.mark.parametrize("kw,match", [({"bandwidth": -1.0}, "bandwidth=-1.0 bytes/s"),
                                      ({"bandwidth": float("nan")}, "bandwidth=nan"),
                                      ({"bandwidth": 0.0}, "> 0"), ({"latency": -1e-6}, "latency=-1e-06 s")])
def test_a_link_profile_refuses_numbers_that_are_not_a_link(kw, match):
    with pytest.raises(ValueError, match=match):
        LinkProfile("bad", **{"bandwidth": 1e9, "latency": 0.0, **kw})


def test_compute_and_host_profiles_refuse_impossible_numbers():
    with pytest.raises(ValueError, match="expert_s=-1"):
        ComputeProfile("bad", 1e-3, 0.0, -1, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="no time"):
        ComputeProfile("zero", 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="dense_s=nan"):
        ComputeProfile("nan", float("nan"), 0.0, 1e-5, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="flops=0"):
        HostProfile("h", 1e9, 0, 1e-5)


def test_every_derived_profile_is_within_2x_of_the_first_hand_estimate():
    for row in compare_profiles():  # two ways of estimating one thing: a wide disagreement means a unit slip
        ratio = row["decode layer ms (roofline)"] / row["decode layer ms (hand)"]
        assert 0.5 < ratio < 2.0, row
    assert set(HAND_PROFILES) == set(COMPUTE_PROFILES)


def test_a_queue_of_reads_overlaps_latency_not_bandwidth_by_hand():
    # 100 us per read, 1 GB/s: a 100 kB read takes 200 us, so one at a time streams 0.5 GB/s,
    # four in flight would stream 2 GB/s but the device caps them at 1 GB/s
    one = LinkProfile("disk", 1e9, 100e-6)
    assert one.stream_bandwidth(100_000) == pytest.approx(0.5e9)
    assert LinkProfile("disk", 1e9, 100e-6, queue_depth=4).stream_bandwidth(100_000) == pytest.approx(1e9)
    assert LinkProfile("disk", 1e9, 100e-6, queue_depth=4).stream_bandwidth(10_000) == pytest.approx(4e4 / 110e-6)
    with pytest.raises(ValueError, match="queue_depth"):
        LinkProfile("disk", 1e9, 100e-6, queue_depth=0)
    with pytest.raises(ValueError, match="read_bytes"):
        one.stream_bandwidth(0)
