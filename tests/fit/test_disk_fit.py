"""The disk's calibration (`fit/disk.py`): one disturbed moment must not become the disk's profile.

Hand examples: samples built from a known latency and bandwidth, with one read size or one round disturbed; the fit
must give back the known figures (a mean over the read sizes, or a single round, does not).
"""
from __future__ import annotations

import pytest

from fate_lab.fit import disk as fit_disk_module
from fate_lab.fit.disk import DiskSample, fit_disk, measure_disk

LAT, BW = 100e-6, 2e9  # the hand disk: 100 us per read, 2 GB/s
SIZES = (64 << 10, 192 << 10, 384 << 10, 1 << 20, 4 << 20)


def _sample(size: int, qd: int, reads: int = 100, slower: float = 1.0) -> DiskSample:
    return DiskSample(size, qd, reads, reads * (LAT + size / BW) * slower)


def test_one_disturbed_read_size_does_not_set_the_latency():
    samples = [_sample(s, 1) for s in SIZES] + [DiskSample(4 << 20, 4, 100, 100 * (4 << 20) / BW)]
    assert fit_disk(samples, 384 << 10).latency == pytest.approx(LAT, rel=1e-9)
    disturbed = [_sample(s, 1, slower=40.0 if s == 1 << 20 else 1.0) for s in SIZES] + samples[len(SIZES):]
    d = fit_disk(disturbed, 384 << 10)
    assert d.latency == pytest.approx(LAT, rel=1e-9)  # a mean over the sizes gives about 4.2 ms
    assert d.bandwidth == pytest.approx(BW)


def test_each_sample_is_its_median_round_and_the_rounds_interleave(tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_bytes(b"\0" * ((4 << 20) + 8192))
    calls: list[tuple[int, int]] = []

    def timed(path, size, offsets, qd):  # the hand disk; the second round's first three samples are disturbed
        calls.append((size, qd))
        slow = 30.0 if len(calls) in (7, 8, 9) else 1.0
        return len(offsets) * (LAT + size / BW) / qd * slow

    monkeypatch.setattr(fit_disk_module, "_timed_reads", timed)
    samples = measure_disk(f, sizes=(64 << 10, 1 << 20), queue_depths=(1, 2, 4), budget_bytes=6 << 20, rounds=3)
    pairs = [(s, q) for s in (64 << 10, 1 << 20) for q in (1, 2, 4)]
    assert calls == pairs * 3  # every size and depth once per round, round after round
    for s in samples:
        assert len(s.per_read) == 3
        assert s.seconds / s.reads == pytest.approx((LAT + s.size / BW) / s.queue_depth)
    assert max(samples[0].per_read) == pytest.approx(30 * (LAT + (64 << 10) / BW))  # the disturbed round was seen
    with pytest.raises(ValueError, match="at least one round"):
        measure_disk(f, rounds=0)
