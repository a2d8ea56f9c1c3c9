"""The disk calibration's fit against a hand example, and its measurement on a real file."""
from __future__ import annotations

import numpy as np
import pytest

from fate_lab.fit.disk import fit_link, measure


def test_fit_recovers_a_hand_made_link():
    # 0.1 ms per read and 1 GB/s: a 1 MB read takes 1.1 ms, a 4 KiB read 0.104096 ms
    samples = [(n, 1e-4 + n / 1e9) for n in (4096, 65536, 393216, 1_000_000)]
    link = fit_link(samples, queue_depth=4)
    assert link.latency == pytest.approx(1e-4, rel=1e-6)
    assert link.bandwidth == pytest.approx(1e9, rel=1e-6)
    assert link.queue_depth == 4


def test_fit_refuses_one_size_and_shrinking_times():
    with pytest.raises(ValueError, match="two sizes"):
        fit_link([(4096, 1e-4), (4096, 2e-4)])
    with pytest.raises(ValueError, match="does not grow"):
        fit_link([(4096, 2e-3), (1 << 20, 1e-4)])


def test_measure_reads_a_real_file(tmp_path):
    p = tmp_path / "d.bin"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 1 << 21, dtype=np.uint8).tobytes())
    samples = measure(p, sizes=(4096, 1 << 20), reads=4)
    assert len(samples) == 8 and all(t > 0 for _, t in samples)
    with pytest.raises(ValueError, match="larger file"):
        measure(p, sizes=(1 << 22,), reads=1)
