"""The driver core by hand: what it builds from a config, and the bookkeeping every driver shares."""
import pytest
import torch
from helpers import ScriptedMover

from fate_lab.core.config import OffloadConfig
from fate_lab.core.driver import DriverCore, link_capacity
from fate_lab.core.recorder import STALL_MIN_S, WINDOW_EMA, spec_label
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.links import LinkProfile
from fate_lab.hardware.setups import Hardware
from fate_lab.quant import QuantSpec

SHAPE = ModelShape(num_layers=4, num_moe_layers=3, num_experts=8, top_k=2, hidden=64, intermediate=64,
                   dtype=torch.float32, dense_bytes=1000, kv_bytes_per_token=10)
EXPERT = 3 * 64 * 64 * 4  # bytes of one fp32 expert of SHAPE


def test_link_capacity_by_hand():
    assert link_capacity(None, 0.0, 1.0) is None and link_capacity(1.0, 0.0, 0.0) is None
    assert link_capacity(1.0, 0.0, 0.4) == 3  # starts at 0, 0.4, 0.8 fall inside the window
    assert link_capacity(1.0, 0.5, 0.25) == 2 and link_capacity(1.0, 2.0, 0.25) == 0
    assert spec_label(None) == "fp" and spec_label(QuantSpec(4, 64)) == "int4/g64"


def test_what_the_core_builds_from_slots_by_hand():
    core = DriverCore(OffloadConfig.preset("fate", slots=7, shallow_layers=1), SHAPE, Hardware(None, None),
                      driver="simulator")
    # shallow-favoring: layer 0 gets its experts first (capped at E = 8), the other 7 - 8 < 0 -> all to it
    assert sum(core.slots_per_layer) == 7 and core.slots_per_layer[0] == 7
    assert core.prefetch_buffers == 2 and core.num_slots == 7 + 2 + 2 * 2  # + top_k demand + two prefetch pools
    assert core.slot_bytes == EXPERT and core.plan.cache_total == 7
    assert core.plan.min_budget_bytes == 1000 + 10 * 512 + (2 + 4) * EXPERT  # dense + KV(512) + (k + pools) slots
    assert core.stats.driver == "simulator" and core.stats.expert_bytes == EXPERT


def test_the_per_forward_bookkeeping_by_hand():
    link = LinkProfile("l", 1e9, 0.0)
    core = DriverCore(OffloadConfig.preset("lru", slots=6, prefetch_window=2.0), SHAPE, Hardware(None, link),
                      driver="runtime")
    core.build_cache(ScriptedMover())
    rec = core.recorder  # what the core records into; the links and the experts call are handed it
    assert rec.stats is core.stats and rec.prefetch_window_s() is None  # no forward yet: no estimate
    core.begin_forward("decode")
    assert rec.phase == "decode"
    rec.stall(0, 1, 0.0, STALL_MIN_S / 2)  # bookkeeping, not a stall
    rec.stall(0, 1, 1.0, 1.4)
    rec.end_forward(2.0)  # 2 s forward, 0.4 s of it stalled, 4 decoder layers
    assert core.stats.layers[0]["decode"].stall_s == pytest.approx(0.4)
    assert rec.window_s["decode"] == pytest.approx(1.6 / 4) and rec.prefetch_window_s() == pytest.approx(0.8)
    core.begin_forward("decode")
    rec.end_forward(4.0)
    assert rec.window_s["decode"] == pytest.approx((1 - WINDOW_EMA) * 0.4 + WINDOW_EMA * 1.0)
    assert core.stats.forward_s["decode"] == [2.0, 4.0] and core.cache.phase == "decode"
    assert [ev[0] for ev in core.stats.timeline] == ["stall"]
    rec.landed(1, 500, None)
    assert core.stats.layers[1]["decode"].bytes_moved == 500 and core.stats.moved["decode", 1, "fp"] == 1
    rec.host(2, 4, 1.0, 1.25)
    assert core.stats.layers[2]["decode"].host_s == pytest.approx(0.25) and core.stats.timeline[-1][0] == "host"
    core.reset_stats(t_origin=10.0)
    assert core.stats.forward_s["decode"] == [] and core.cache.stats is core.stats.layers
    rec.event("compute", 0, 3, 10.5, 11.0)
    assert core.stats.timeline == [("compute", 0, 3, 0.5, 1.0)]
    with pytest.raises(ValueError, match="phase 'warmup'"):
        core.begin_forward("warmup")


def test_all_resident_preloads_every_expert_and_quant_sizes_the_slot():
    core = DriverCore(OffloadConfig.preset("all_resident"), SHAPE, Hardware(None, None), driver="replay")
    core.build_cache(ScriptedMover())
    pre = core.preload()
    assert len(pre) == 3 * 8 and {(m, e) for m, e, _ in pre} == {(m, e) for m in range(3) for e in range(8)}
    q = DriverCore(OffloadConfig.preset("fate_quant", slots=6), SHAPE, Hardware(None, None), driver="replay")
    assert q.slot_specs and None not in q.slot_specs and q.slot_bytes < EXPERT  # packed INT4 / INT2 slots
    with pytest.raises(ValueError, match="group size divides hidden 64 and expert width 48"):
        DriverCore(OffloadConfig.preset("fate_quant", slots=6), ModelShape(4, 3, 8, 2, 64, 48, torch.float32, 0, 0),
                   Hardware(None, None), driver="replay")


def test_the_core_refuses_what_is_not_a_config():
    with pytest.raises(TypeError, match="OffloadConfig"):
        DriverCore({"preset": "fate"}, SHAPE, Hardware(None, None), driver="replay")
