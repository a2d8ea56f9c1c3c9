"""The simulator's disk model (a profile with `read_host_s`): reads served one at a time at the pace the compute
thread leaves them, and compute slowed by the readers busy beside it -- each checked against hand-computed times."""
from __future__ import annotations

import pytest
import torch
from helpers import SilentRecorder

from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.links import LinkProfile
from fate_lab.sim.simulate import ModelShape, SimClock, SimMover

LAT, BW = 1e-3, 1e6  # 1 ms per read, 1 MB/s: a 1000-byte read moves its bytes in 1 ms
# a read's host work: 0.25 ms per read + 0.25 us per byte with the compute thread waiting (0.5 ms for 1000 bytes),
# 0.5 ms + 1 us per byte beside it (1.5 ms); so a 1000-byte read takes 2.5 ms alone and 3.5 ms beside compute. One
# busy reader makes compute 2x slower, two 3x.
DISK = dict(read_host_s=(0.25e-3, 0.25e-6), read_host_busy_s=(0.5e-3, 1e-6), reader_slowdown=(2.0, 3.0))


class _Shape(ModelShape):
    def nbytes(self, spec=None) -> int:
        return 1000 if spec is None else 250


def _mover(depth: int = 2, **disk) -> SimMover:
    shape = _Shape(2, 1, 4, 1, 8, 8, torch.float32, 0, 0)
    compute = ComputeProfile("disk", 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, **(disk or DISK))
    return SimMover(SilentRecorder().spec, SilentRecorder(),
                    SimClock(), LinkProfile("hand", BW, LAT, queue_depth=depth), compute, shape)


def test_reads_waited_on_run_one_at_a_time_at_the_idle_pace():
    # three misses queued at 0: the first starts beside compute (3.5 ms), the wait at 0 finishes it at the idle pace
    # (its rest x 2.5 / 3.5: 2.5 ms); each next one starts when the last ends, and is waited on at once: 5, 7.5 ms
    link = _mover()
    xs = [link.submit(0, e, e, urgent=True, reason="miss") for e in range(3)]
    for e, x in enumerate(xs):
        link.wait(0, e, x)
    assert [x.end for x in xs] == pytest.approx([2.5e-3, 5e-3, 7.5e-3])
    assert link.clock.now == pytest.approx(7.5e-3)


def test_a_read_beside_compute_takes_its_busy_time_and_slows_the_compute():
    link = _mover()
    x = link.submit(0, 0, 0, urgent=False, reason="prefetch")
    assert x.end == pytest.approx(3.5e-3)  # 1 ms latency + 1 ms bytes + 1.5 ms host work beside compute
    link.stretch(1e-3)  # one reader busy: 2x, 1 ms of work ends at 2 ms
    assert link.clock.now == pytest.approx(2e-3)
    link.stretch(2e-3)  # 2-3.5 ms at 2x does 0.75 ms of it; the rest, 1.25 ms, alone: 4.75 ms
    assert link.clock.now == pytest.approx(4.75e-3)


def test_two_reads_queued_make_two_busy_readers_until_one_is_left():
    link = _mover()
    link.submit(0, 0, 0, urgent=False, reason="prefetch")  # runs 0-3.5 ms
    second = link.submit(0, 1, 1, urgent=False, reason="prefetch")  # queued behind it
    link.stretch(1e-3)  # two readers busy: 3x, ends at 3 ms
    assert link.clock.now == pytest.approx(3e-3)
    # 3-3.5 ms at 3x does 1/6 ms; the second read starts at 3.5 ms (beside compute: ends 7 ms) and is the only one,
    # so the remaining 5/6 ms of work run at 2x: 3.5 + 5/3 ms
    link.stretch(1e-3)
    assert second.start == pytest.approx(3.5e-3) and second.end == pytest.approx(7e-3)
    assert link.clock.now == pytest.approx(3.5e-3 + 5e-3 / 3)
    # a depth-1 disk has one reader thread: both reads queued slow compute only 2x
    one = _mover(depth=1, read_host_s=DISK["read_host_s"], read_host_busy_s=DISK["read_host_busy_s"],
                 reader_slowdown=(2.0,))
    one.submit(0, 0, 0, urgent=False, reason="prefetch")
    one.submit(0, 1, 1, urgent=False, reason="prefetch")
    one.stretch(1e-3)
    assert one.clock.now == pytest.approx(2e-3)


def test_the_compute_threads_work_to_queue_a_read_is_slowed_by_the_busy_readers():
    # 0.4 ms of the compute thread's own work per read it queues (transfer_host_s): the first submit finds no reader
    # busy (0.4 ms at 1x), the second finds one busy (2x: 0.8 ms), the third two (3x: 1.2 ms); on an emulated link
    # (no disk model) the same work is never slowed
    link = _mover(transfer_host_s=0.4e-3, **DISK)
    for e in range(3):
        link.submit(0, e, e, urgent=False, reason="prefetch")
    assert link.clock.now == pytest.approx(0.4e-3 + 0.8e-3 + 1.2e-3)
    plain = SimMover(SilentRecorder().spec, SilentRecorder(), SimClock(), LinkProfile("hand", BW, LAT),
                     ComputeProfile("emulated", 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, transfer_host_s=0.4e-3),
                     _Shape(2, 1, 4, 1, 8, 8, torch.float32, 0, 0))
    for e in range(3):
        plain.submit(0, e, e, urgent=False, reason="prefetch")
    assert plain.clock.now == pytest.approx(1.2e-3)


def test_a_packed_read_pays_the_host_work_per_read_and_per_byte():
    link = _mover()
    # a quarter of the bytes (250): 1 ms latency + 0.25 ms bytes + 0.25 ms + 250 x 0.25 us of host work, waiting
    assert link._read_s(250, idle=True) == pytest.approx(1.5625e-3)
    assert link._read_s(1000, idle=False) == pytest.approx(3.5e-3)


def test_the_host_work_line_goes_through_the_full_and_the_packed_read():
    from fate_lab.fit.contention import Contention

    # the reads of the hand profile above, as measure_contention would time them: full 2.5 ms alone, 3.5 ms busy;
    # packed (250 bytes) 1.5625 ms alone, 1 + 0.25 + 0.5 + 0.25 = 2 ms busy
    c = Contention(2.5e-3, 3.5e-3, (2.0, 3.0), (2.0, 3.0), 0.01, 1000, 1.5625e-3, 2e-3, 250)
    assert c.host_line(LAT, BW, busy=False) == pytest.approx(DISK["read_host_s"])
    assert c.host_line(LAT, BW, busy=True) == pytest.approx(DISK["read_host_busy_s"])
    # no packed copy: all of it per byte, through the full read
    alone = Contention(2.5e-3, 3.5e-3, (2.0, 3.0), (2.0, 3.0), 0.01, 1000)
    assert alone.host_line(LAT, BW, busy=False) == pytest.approx((0.0, 0.5e-6))


def test_a_dense_layer_takes_its_own_slowdown():
    link = _mover(**DISK, reader_slowdown_dense=(1.5, 2.5))
    link.submit(0, 0, 0, urgent=False, reason="prefetch")  # runs 0-3.5 ms: one reader busy
    link.stretch(1e-3, dense=True)  # 1.5x: 1.5 ms
    assert link.clock.now == pytest.approx(1.5e-3)
    link.stretch(1e-3)  # an experts call's piece: 2x, 3.5 ms
    assert link.clock.now == pytest.approx(3.5e-3)


def test_a_prefill_takes_the_prefill_slowdowns_and_a_decode_step_the_decode_ones():
    link = _mover(**DISK, reader_slowdown_dense=(1.5, 2.5), reader_slowdown_prefill=(4.0, 5.0),
                  reader_slowdown_prefill_dense=(3.0, 4.0))
    link.rec.phase = "prefill"
    link.submit(0, 0, 0, urgent=False, reason="prefetch")  # runs 0-3.5 ms: one reader busy
    link.stretch(0.25e-3, dense=True)  # a prefill's dense layer: 3x, 0.75 ms
    assert link.clock.now == pytest.approx(0.75e-3)
    link.stretch(0.25e-3)  # a prefill's experts piece: 4x, 1.75 ms
    assert link.clock.now == pytest.approx(1.75e-3)
    link.rec.phase = "decode"
    link.stretch(0.25e-3, dense=True)  # a decode step's dense layer: 1.5x, 2.125 ms
    assert link.clock.now == pytest.approx(2.125e-3)
    link.stretch(0.25e-3)  # a decode step's experts piece: 2x, 2.625 ms
    assert link.clock.now == pytest.approx(2.625e-3)
    only_calls = _mover(**DISK, reader_slowdown_prefill=(4.0, 5.0))  # no prefill dense figure: the calls' serve
    only_calls.rec.phase = "prefill"
    only_calls.submit(0, 0, 0, urgent=False, reason="prefetch")
    only_calls.stretch(0.25e-3, dense=True)
    assert only_calls.clock.now == pytest.approx(1e-3)


def test_a_prefills_prediction_takes_its_own_measured_slowdown_and_a_decode_ones_the_calls():
    # one figure for a prefill's predictions (the calibration's cold prefill measured them beside its readers),
    # whatever the readers busy; a decode step's predictions, and a prefill's without the figure, take the calls'
    link = _mover(**DISK, reader_slowdown_prefill=(4.0, 5.0), reader_slowdown_predict_prefill=(1.5,))
    link.rec.phase = "prefill"
    link.submit(0, 0, 0, urgent=False, reason="prefetch")  # runs 0-3.5 ms
    link.submit(0, 1, 1, urgent=False, reason="prefetch")  # queued: two readers busy
    link.stretch(1e-3, predict=True)  # 1.5x, not the calls' 5x: 1.5 ms
    assert link.clock.now == pytest.approx(1.5e-3)
    link.stretch(0.1e-3)  # an experts piece beside two readers: 5x, 2 ms
    assert link.clock.now == pytest.approx(2e-3)
    link.rec.phase = "decode"
    link.stretch(0.1e-3, predict=True)  # a decode prediction: the decode calls' 3x, 2.3 ms
    assert link.clock.now == pytest.approx(2.3e-3)
    without = _mover(**DISK, reader_slowdown_prefill=(4.0, 5.0))
    without.rec.phase = "prefill"
    without.submit(0, 0, 0, urgent=False, reason="prefetch")  # one reader busy
    without.stretch(0.5e-3, predict=True)  # the prefill calls' 4x: 2 ms
    assert without.clock.now == pytest.approx(2e-3)


def test_without_readers_busy_compute_runs_at_its_own_pace():
    link = _mover()
    link.stretch(4e-3)
    assert link.clock.now == pytest.approx(4e-3)


@pytest.mark.parametrize("bad, match", [(dict(read_host_s=(1e-4, 0.0)), "without reader_slowdown"),
                                        (dict(read_host_s=(1e-4, 0.0), reader_slowdown=(0.5,)), "reader_slowdown"),
                                        (dict(read_host_s=(1e-4, 0.0), reader_slowdown=(2.0,),
                                              reader_slowdown_predict_prefill=(0.5,)), "predict_prefill"),
                                        (dict(read_host_s=(-1.0, 0.0), reader_slowdown=(2.0,)), "read_host_s"),
                                        (dict(read_host_s=1e-4, reader_slowdown=(2.0,)), "per read, seconds per")])
def test_a_disk_model_profile_that_cannot_hold_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ComputeProfile("bad", 1e-3, 0.0, 1e-4, 0.0, 0.0, 0.0, **bad)


def test_measuring_contention_needs_a_reader():
    from fate_lab.fit.contention import measure_contention

    with pytest.raises(ValueError, match="at least one reader"):
        measure_contention(None, torch.zeros(1, 4, dtype=torch.long), depth=0)


def test_a_read_goes_faster_by_the_readers_overlap_while_another_waits_behind_it():
    # overlap 2 (two readers read twice as many per second as one): the first read starts alone (3.5 ms beside
    # compute); at 1 ms a second is queued behind it, so its remaining 2.5 ms take 1.25 ms (ends 2.25 ms); the second
    # then starts with nothing behind it and takes its full 3.5 ms (ends 5.75 ms). Overlap 1 leaves every time as it
    # was: 3.5 and 7 ms.
    for overlap, ends in ((2.0, (2.25e-3, 5.75e-3)), (1.0, (3.5e-3, 7e-3))):
        link = _mover(**DISK, reader_overlap=overlap)
        first = link.submit(0, 0, 0, urgent=False, reason="prefetch")
        link.clock.now = 1e-3
        second = link.submit(0, 1, 1, urgent=False, reason="prefetch")
        link.clock.now = 10e-3
        link.busy()  # the link reaches the second read
        assert (first.end, second.end) == pytest.approx(ends)
    with pytest.raises(ValueError, match="reader_overlap=0.5"):
        ComputeProfile("bad", 1e-3, 0.0, 1e-4, 0.0, 0.0, 0.0, reader_overlap=0.5)


def test_the_readers_overlap_is_measured_as_reads_per_second_of_two_over_one(monkeypatch):
    from fate_lab.fit import contention

    # fake trials: one reader alone reads in 1 ms, two readers alone each in 1.25 ms (1.6x the reads per second);
    # every other figure 1, so the slow-downs are 1
    def fake_measure(model, ids, preset, kinds, rounds=contention.ROUNDS):
        out = {k: [([1.25e-3] if k == (2, False) else [1e-3], 1.0, 1.0)] for k in kinds}
        return out, 1000

    monkeypatch.setattr(contention, "_measure", fake_measure)
    monkeypatch.setattr(contention, "_check_memory", lambda model: None)
    monkeypatch.setattr(contention, "_packable", lambda model: False)
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert contention.measure_contention(None, ids, depth=2).overlap == pytest.approx(1.6)
    assert contention.measure_contention(None, ids, depth=1).overlap == 1.0


def test_the_contention_trials_run_the_rounds_asked_for(monkeypatch):
    from fate_lab.fit import contention

    rounds_seen = []

    def fake_measure(model, ids, preset, kinds, rounds=contention.ROUNDS):
        rounds_seen.append(rounds)
        return {k: [([1e-3], 1.0, 1.0)] * rounds for k in kinds}, 1000

    monkeypatch.setattr(contention, "_measure", fake_measure)
    monkeypatch.setattr(contention, "_check_memory", lambda model: None)
    monkeypatch.setattr(contention, "_packable", lambda model: True)
    ids = torch.zeros(1, 4, dtype=torch.long)
    contention.measure_contention(None, ids, depth=2, rounds=1)
    contention.measure_contention(None, ids, depth=2)
    assert rounds_seen == [1, 1, contention.ROUNDS, contention.ROUNDS]  # the full trials, then the packed reads
    with pytest.raises(ValueError, match="rounds=0"):
        contention.measure_contention(None, ids, rounds=0)
