"""One calibration of this machine per run, with torch's threads pinned, and a re-check of it at the end.

What it is: `pinned` (torch's intra-op thread count held at `THREADS` while calibrating and measuring: on a
shared 2-core machine the default two threads made one decode layer swing between 3 and 13 ms), `calibrate`
(the median of several layer-time calibrations, with their spread), `machine_clock` (that calibration once
per run: once per process, and shared by every notebook of a main-job run through a file in
``$FATE_LAB_RUN_DIR``), and `recheck` (the same measurement again at the end of a notebook: a `Drift` that
says whether the machine's speed changed while the notebook measured, as a verdict row).
What it is not: the layer-time measurement itself (`offloading.transfer.calibrate_layer_time`) or the
compute profile of the simulator (`fit.calibrate.calibrate_compute`).
"""
from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

THREADS = 1  # torch intra-op threads while calibrating and measuring (module docstring)
REPEATS = 5  # calibrations per clock; the median is the clock
DRIFT_TOLERANCE = 0.15  # a re-check more than 15% away from the clock says the machine drifted
RUN_DIR_ENV = "FATE_LAB_RUN_DIR"  # set by the main job: every notebook of the run shares one clock

_clocks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> Clock (this process)


@contextmanager
def pinned(threads: int = THREADS) -> Iterator[None]:
    """Hold torch's intra-op thread count at `threads` inside the block (restored after)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r}: give an int >= 1")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def spread(samples) -> float:
    """Relative half-range of some measurements: (max - min) / 2 / median (0 for one sample)."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        return float("nan")
    med = xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2
    return (xs[-1] - xs[0]) / 2 / med if med else float("nan")


def median(samples) -> float:
    """The median of some measurements."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        return float("nan")
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


@dataclass(frozen=True)
class Clock:
    """This machine's decode-layer time for one model: the median of several calibrations."""

    model: str  # the model's folder (its config's name_or_path)
    layer_s: float  # seconds of one decoder layer in a batch-1 decode step (the median of `samples`)
    samples: tuple[float, ...]
    threads: int

    @property
    def spread(self) -> float:
        """Relative half-range of the calibrations."""
        return spread(self.samples)

    def describe(self) -> str:
        """One line: the layer time, how it was measured and its spread."""
        return (f"one decode layer {self.layer_s * 1e3:.3g} ms (median of {len(self.samples)} calibrations, "
                f"±{self.spread:.0%}; {self.threads} torch thread{'s' if self.threads > 1 else ''})")


def _model_key(model) -> str:
    return str(getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__)


def calibrate(model, repeats: int = REPEATS, steps: int = 24, threads: int = THREADS) -> Clock:
    """`repeats` layer-time calibrations with threads pinned; the clock is their median."""
    from fate_lab.offloading.transfer import calibrate_layer_time

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: give an int >= 1")
    with pinned(threads):
        calibrate_layer_time(model, steps=4)  # warm-up: first calls allocate
        samples = tuple(calibrate_layer_time(model, steps=steps) for _ in range(repeats))
    return Clock(_model_key(model), median(samples), samples, threads)


def _run_file() -> Path | None:
    raw = os.environ.get(RUN_DIR_ENV, "").strip()
    return Path(raw) / "clock.json" if raw else None


def machine_clock(model, threads: int = THREADS) -> Clock:
    """This machine's clock for `model`, calibrated once per run (module docstring)."""
    if model in _clocks and _clocks[model].threads == threads:
        return _clocks[model]
    file, key = _run_file(), f"{_model_key(model)}|threads={threads}"
    saved = json.loads(file.read_text()) if file is not None and file.is_file() else {}
    if key in saved:
        clock = Clock(saved[key]["model"], saved[key]["layer_s"], tuple(saved[key]["samples"]), saved[key]["threads"])
    else:
        clock = calibrate(model, threads=threads)
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
            saved[key] = {"model": clock.model, "layer_s": clock.layer_s, "samples": list(clock.samples),
                          "threads": clock.threads}
            file.write_text(json.dumps(saved, indent=1))
    _clocks[model] = clock
    return clock


@dataclass(frozen=True)
class Drift:
    """The clock against a re-measurement at the end: did the machine's speed change meanwhile?"""

    clock: Clock
    now: Clock

    @property
    def change(self) -> float:
        """Relative change of the layer time (+0.2: layers now take 20% longer: the machine got slower)."""
        return self.now.layer_s / self.clock.layer_s - 1

    @property
    def drifted(self) -> bool:
        """True when the change is beyond `DRIFT_TOLERANCE` and beyond both measurements' spread."""
        return abs(self.change) > max(DRIFT_TOLERANCE, self.clock.spread + self.now.spread)

    def describe(self) -> str:
        """One sentence for a reader."""
        base = (f"one decode layer took {self.clock.layer_s * 1e3:.3g} ms when calibrated and "
                f"{self.now.layer_s * 1e3:.3g} ms at the end ({self.change:+.0%})")
        if self.drifted:
            return (f"the machine's speed DRIFTED while this notebook measured: {base}; the emulated link kept the "
                    "first clock, so the speed rows are not at the paper's transfer/compute ratio")
        return f"the machine's speed held: {base}"

    def claim(self):
        """The drift as a verdict row (our target: within the tolerance)."""
        from fate_lab.study import verdict

        tol = max(DRIFT_TOLERANCE, self.clock.spread + self.now.spread)
        return verdict.close("machine speed at the end vs at calibration (decode layer time)", 1.0,
                             self.now.layer_s / self.clock.layer_s, tol, unit="x",
                             reference=f"target: within ±{tol:.0%}", source="target")


def recheck(model, clock: Clock | None = None) -> Drift:
    """Measure the layer time again (as `calibrate`, 3 repeats) and compare it with the run's clock."""
    clock = clock or machine_clock(model)
    return Drift(clock, calibrate(model, repeats=3, threads=clock.threads))


__all__ = ["Clock", "DRIFT_TOLERANCE", "Drift", "RUN_DIR_ENV", "THREADS", "calibrate", "machine_clock", "median",
           "pinned", "recheck", "spread"]
