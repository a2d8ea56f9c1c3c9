"""O_DIRECT reads against plain Python reads of the same bytes, and the errors of a file that changes under them."""
from __future__ import annotations

import os

import numpy as np
import pytest

from fate_lab.offloading.direct import ALIGN, DirectFile, DirectReader, aligned_buffer, span


@pytest.fixture
def data_file(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=5 * ALIGN + 123, dtype=np.uint8).tobytes()
    p = tmp_path / "x.bin"
    p.write_bytes(data)
    return p, data


def test_unaligned_ranges_match_a_plain_read(data_file):
    p, data = data_file
    buf = aligned_buffer(len(data) + 2 * ALIGN)
    with DirectFile(p) as f:
        for off, n in [(0, 1), (1, ALIGN), (ALIGN - 1, 2), (3 * ALIGN + 7, 2 * ALIGN + 116), (0, len(data))]:
            assert bytes(f.read_into(off, n, buf)) == data[off:off + n]


def test_span_rounds_out_to_blocks():
    assert span(0, 1) == ALIGN
    assert span(ALIGN - 1, 2) == 2 * ALIGN
    assert span(ALIGN, ALIGN) == ALIGN


def test_reader_pool_returns_ranges_in_order(data_file):
    p, data = data_file
    ranges = [(p, o, 1000) for o in range(0, len(data) - 1000, 777)]
    r = DirectReader(queue_depth=3, max_bytes=1000)
    try:
        assert r.read(ranges) == [data[o:o + n] for _, o, n in ranges]
    finally:
        r.close()


def test_truncated_and_vanished_files_are_one_clear_error(data_file):
    p, data = data_file
    r = DirectReader(queue_depth=2, max_bytes=ALIGN)
    try:
        assert r.read([(p, 0, 100)]) == [data[:100]]
        os.truncate(p, 2 * ALIGN)
        with pytest.raises(OSError, match="truncated|shrank"):
            r.read([(p, 4 * ALIGN, 100)])
        p.unlink()
        with pytest.raises(FileNotFoundError, match="gone"):
            r.read([(p, 0, 100), (p, 10, 10)])
    finally:
        r.close()

