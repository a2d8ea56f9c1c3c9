"""One calibration per run (study/clock.py): threads pinned and restored, the median of several, shared through
the run folder, and a drift said when the machine's speed changed."""
import json

import pytest
import torch

from fate_lab.study import clock


def test_pinned_holds_the_thread_count_and_restores_it():
    before = torch.get_num_threads()
    with clock.pinned(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        with clock.pinned(0):
            pass


def test_median_and_spread_by_hand():
    assert clock.median([3.0, 1.0, 2.0]) == 2.0 and clock.median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert clock.spread([0.9, 1.0, 1.1]) == pytest.approx(0.1)
    assert clock.spread([2.0]) == 0.0


def test_calibrate_is_the_median_of_its_samples(tiny_models):
    model = tiny_models("qwen2_moe")
    c = clock.calibrate(model, repeats=3, steps=4)
    assert len(c.samples) == 3 and c.layer_s == clock.median(c.samples) and c.threads == clock.THREADS
    assert "median of 3 calibrations" in c.describe()


def test_machine_clock_is_shared_through_the_run_folder(tiny_models, tmp_path, monkeypatch):
    model = tiny_models("qwen2_moe")
    monkeypatch.setenv(clock.RUN_DIR_ENV, str(tmp_path))
    first = clock.machine_clock(model)
    saved = json.loads((tmp_path / "clock.json").read_text())
    assert [v["layer_s"] for v in saved.values()] == [first.layer_s]
    other = tiny_models("qwen2_moe")  # another kernel of the same run: same clock, read from the file
    assert clock.machine_clock(other) == first


def test_drift_is_said_beyond_the_tolerance():
    c = clock.Clock("m", 0.003, (0.003, 0.003, 0.003), 1)
    steady = clock.Drift(c, clock.Clock("m", 0.0031, (0.0031,) * 3, 1))
    assert not steady.drifted and steady.claim().verdict == "agrees" and "held" in steady.describe()
    slow = clock.Drift(c, clock.Clock("m", 0.0045, (0.0045,) * 3, 1))
    assert slow.drifted and slow.change == pytest.approx(0.5)
    assert slow.claim().verdict == "disagrees" and "DRIFTED" in slow.describe()
