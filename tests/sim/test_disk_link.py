"""The simulator's link with a queue of reads in flight (link="disk"), checked against hand-computed times."""
from __future__ import annotations

import pytest
import torch
from helpers import SilentRecorder

from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.links import LinkProfile
from fate_lab.sim.simulate import ModelShape, SimClock, SimMover

LAT, BW = 1e-3, 1e6  # 1 ms per read, 1 MB/s: a 1000-byte read moves its bytes in 1 ms


class _Shape(ModelShape):
    def nbytes(self, spec=None) -> int:
        return 1000


def _ends(depth: int, n: int, urgent: bool = True, **extra) -> list[float]:
    shape = _Shape(2, 1, 4, 1, 8, 8, torch.float32, 0, 0)
    compute = ComputeProfile("link only", 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, **extra)
    profile = LinkProfile("hand", BW, LAT, queue_depth=depth)
    link = SimMover(SilentRecorder().spec, SilentRecorder(), SimClock(), profile, compute, shape)
    xs = [link.submit(0, e, e, urgent=urgent, reason="miss" if urgent else "prefetch") for e in range(n)]
    for e, x in enumerate(xs):
        link.wait(0, e, x)
    return [x.end for x in xs]


def test_depth_one_is_latency_plus_bytes_per_read_back_to_back():
    assert _ends(1, 3) == pytest.approx([2e-3, 4e-3, 6e-3])


def test_a_deeper_queue_overlaps_the_latencies_but_not_the_bytes():
    # two entries: both latencies run at once (0-1 ms); the bytes take turns on the wire (1-2 ms, 2-3 ms); the
    # third read takes the first free entry at 2 ms, its latency ends at 3 ms and its bytes follow (3-4 ms)
    assert _ends(2, 3) == pytest.approx([2e-3, 3e-3, 4e-3])
    # a queue deep enough: bandwidth-bound, one read's bytes per ms after the first latency
    assert _ends(8, 4) == pytest.approx([2e-3, 3e-3, 4e-3, 5e-3])
    link = LinkProfile("hand", BW, LAT, queue_depth=2)  # the profile's streaming rate agrees: 2 x 1000 B / 2 ms
    assert link.stream_bandwidth(1000) == pytest.approx(1e6)


def test_an_experts_checkpoint_bytes_match_its_shape_by_hand():
    import json

    from fate_lab.paths import model_dir
    from fate_lab.study.whatif import checkpoint_expert_bytes

    for name in ("tiny_moe", "tiny_deepseek"):
        file = model_dir(name) / "model.safetensors"
        if not file.is_file():
            pytest.skip(f"embedded model data/{name} not present")
        cfg = json.loads((model_dir(name) / "config.json").read_text())
        width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        assert checkpoint_expert_bytes(file) == 3 * cfg["hidden_size"] * width * 2  # gate, up, down in bfloat16


def test_the_link_overshoot_is_read_off_by_hand_timed_moves():
    # what the calibration charges each transfer beyond the simulator's link, from hand-timed moves
    from fate_lab.fit.calibrate import link_overshoot

    one = LinkProfile("copy engine", BW, LAT)  # depth 1: 1000 bytes take 1 ms of latency + 1 ms of bytes
    # each move's own overshoot: 0.5, 0.5, 0 ms; the median, so that one stray move does not speak for the rest
    assert link_overshoot([(0.0, 2.5e-3), (3e-3, 5.5e-3), (6e-3, 8e-3)], 1000, one) == pytest.approx(0.5e-3)
    assert link_overshoot([(0.0, 2.5e-3), (3e-3, 5.5e-3), (6e-3, 30e-3)], 1000, one) == pytest.approx(0.5e-3)
    disk = LinkProfile("disk", BW, LAT, queue_depth=2)
    # two reads side by side, done together in 3 ms: the one wire passes 2 x (1 ms of bytes + overshoot) after one
    # latency, so the overshoot is 0 (each alone taking 3 ms would have been 1 ms over)
    assert link_overshoot([(0.0, 3e-3), (0.0, 3e-3)], 1000, disk) == pytest.approx(0.0, abs=1e-12)
    # the second read's bytes follow the first's end (4 ms): 5 - 4 - 1 = 0 over; the first 4 - 1 - 1 = 2; the third
    # ran alone: 12.5 - 11 - 1 = 0.5. Mean 2.5 / 3; the third alone 0.5
    moves = [(0.0, 4e-3), (1e-3, 5e-3), (10e-3, 12.5e-3)]
    assert link_overshoot(moves, 1000, disk) == pytest.approx(2.5e-3 / 3)
    assert link_overshoot(moves, 1000, disk, among=[2]) == pytest.approx(0.5e-3)


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_the_link_overshoot_inverts_the_simulated_link(depth):
    # the simulator's own link, given overshoots, times a burst of reads (demand loads queued before prefetches);
    # the calibration's estimate, read off those times, gives each kind's overshoot back
    from fate_lab.fit.calibrate import link_overshoot

    shape = _Shape(2, 1, 4, 1, 8, 8, torch.float32, 0, 0)
    compute = ComputeProfile("link only", 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, link_extra_s=0.7e-3, demand_extra_s=0.2e-3)
    profile = LinkProfile("hand", BW, LAT, queue_depth=depth)
    link = SimMover(SilentRecorder().spec, SilentRecorder(), SimClock(), profile, compute, shape)
    urgent = [False, True, False, False, True, False, True]
    xs = [link.submit(0, e, e, urgent=u, reason="miss" if u else "prefetch") for e, u in enumerate(urgent)]
    for e, x in enumerate(xs):
        link.wait(0, e, x)
    spans = [(x.start, x.end) for x in xs]
    assert link_overshoot(spans, 1000, profile, among=[i for i, u in enumerate(urgent) if u]) == pytest.approx(0.2e-3)
    assert link_overshoot(spans, 1000, profile, among=[i for i, u in enumerate(urgent) if not u]) == pytest.approx(
        0.7e-3)


def test_a_demand_read_and_a_prefetch_pay_their_own_measured_overshoot():
    # 0.5 ms over for a prefetch (its CPU work shares the cores with compute), 0.1 ms for a demand load; each
    # follows its bytes on the wire: depth 1, back to back: 2.5, 5, 7.5 ms and 2.1, 4.2, 6.3 ms
    both = dict(link_extra_s=0.5e-3, demand_extra_s=0.1e-3)
    assert _ends(1, 3, urgent=False, **both) == pytest.approx([2.5e-3, 5e-3, 7.5e-3])
    assert _ends(1, 3, urgent=True, **both) == pytest.approx([2.1e-3, 4.2e-3, 6.3e-3])
    assert _ends(1, 3, urgent=True, link_extra_s=0.5e-3) == pytest.approx([2.5e-3, 5e-3, 7.5e-3])  # None: the same
