"""Device compute profiles: the seconds each piece of one forward takes, for the timed simulator.

What this file is: `ComputeProfile` (per-layer dense compute, per-expert compute, the experts call's
bookkeeping, the host-side prediction, and what a CPU emulation of a link costs), checked to hold finite,
non-negative seconds.
What it is not: the named profiles (`profiles.py`: derived by the roofline from data-sheet specs) or a
calibration of this machine (`fate_lab/fit/calibrate.py` measures one from the runtime).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

_SLOWDOWNS = ("reader_slowdown", "reader_slowdown_dense", "reader_slowdown_prefill", "reader_slowdown_prefill_dense",
              "reader_slowdown_predict_prefill")
_OPTIONAL = ("demand_extra_s", "dense_prefill_s", "expert_prefill_s", "call_prefill_s", "predict_prefill_s")


@dataclass(frozen=True)
class ComputeProfile:
    """Seconds the device (and host) spend per piece of one forward; T tokens in the step."""

    name: str
    dense_s: float  # one decoder layer without its routed experts, one decode token
    dense_per_token_s: float  # extra per additional token of a prefill step
    expert_s: float  # one routed expert on one token (incl. the runtime's per-expert bookkeeping)
    expert_per_token_s: float  # extra per additional token routed to that expert
    call_s: float  # the experts call's own bookkeeping (cache, routing ids to the host)
    predict_s: float  # host-side cross-layer prediction of one layer, one token
    predict_per_token_s: float = 0.0  # extra per additional token
    expert_cold_s: float = 0.0  # extra for an expert whose bytes just landed (CPU emulation: they sit in
    # the other core's cache; 0 on a GPU, where a kernel reads device memory either way)
    landed_s: float = 0.0  # extra dense time per landed transfer or host-computed expert (CPU emulation: the
    # link's copies, or the host compute reading the expert, evict the dense weights from the shared caches;
    # the next dense layer pays it, at most its own time again; 0 on a GPU)
    link_extra_s: float = 0.0  # an emulated transfer's overshoot beyond latency + bytes/bandwidth (sleep
    # granularity of the worker thread); 0 for a real link
    demand_extra_s: float | None = None  # a demand transfer's overshoot where it differs from a prefetch's
    # (link_extra_s): on the disk a demand read runs while the compute thread waits, so the read's own CPU work
    # (conversion, digest, copy) has the cores to itself; a prefetch read shares them with compute. None: the same
    wake_s: float = 0.0  # from a transfer landing to the waiting compute thread running again
    source: str = ""
    busy_factor: float = 1.0  # the expert, prediction and call pieces take this many times as long while the
    # link is copying (CPU emulation: the copy thread shares the memory bus and the interpreter lock); 1 on a GPU
    transfer_host_s: float = 0.0  # the compute thread's own time per transfer it queues (slot bookkeeping,
    # handing the copy to the link, reaping it); ~0 on a GPU next to a layer's compute. The disk model charges it
    # alone and slows it by the readers busy at each submit, as it does the calls' other pieces
    dequant_s: float = 0.0  # one packed expert dequantized into the full-precision scratch before it computes (each
    # compute from a packed slot): the runtime's own dequantize timed on this machine at INT4 (fit/calibrate.py);
    # 0 in the data-sheet GPU profiles, which no measurement of it backs
    read_host_s: tuple[float, float] | None = None  # a disk read's host work (digest check, conversion, copy into
    # its slot) beyond the disk's latency + bytes / bandwidth, the compute thread waiting: (seconds per read, seconds
    # per byte); set, the simulator runs the disk model below instead of link_extra_s, demand_extra_s, busy_factor
    # and landed_s: reads served one at a time (faster by reader_overlap while another waits), each compute piece slowed
    # by the readers busy beside it (fit/contention.py measures both)
    read_host_busy_s: tuple[float, float] = (0.0, 0.0)  # the same while the compute thread runs beside the read
    reader_overlap: float = 1.0  # the disk model's reads go this many times as fast while another read waits behind
    # them (reads per second of the queue depth's readers over one's, measured: 1 where they do not overlap)
    reader_slowdown: tuple[float, ...] = ()  # the compute thread's slow-down with 1, 2, ... reader threads busy: of
    # the experts calls' pieces (experts, bookkeeping, prediction, dequantize)
    reader_slowdown_dense: tuple[float, ...] = ()  # ... of the dense layers (empty: reader_slowdown's)
    reader_slowdown_prefill: tuple[float, ...] = ()  # ... of a prefill's experts calls (empty: the decode figures)
    reader_slowdown_prefill_dense: tuple[float, ...] = ()  # ... of a prefill's dense layers
    reader_slowdown_predict_prefill: tuple[float, ...] = ()  # ... of a prefill's predictions (empty: its experts
    # calls'): one figure, measured in the calibration's cold prefill over the disk, where the readers ran throughout
    # a multi-token step (a prefill) runs other code than a decode step (rows gathered per expert, masks, the
    # KV cache begun): its pieces' times at 1 token, the intercepts of lines fitted through two prefill lengths
    # (None: the decode figure, the line through it and one prefill)
    dense_prefill_s: float | None = None
    expert_prefill_s: float | None = None
    call_prefill_s: float | None = None
    call_per_token_s: float = 0.0  # the experts call's bookkeeping per additional token of a prefill step
    predict_prefill_s: float | None = None
    predictors: tuple[tuple, ...] = ()  # (predictor, predict_s, predict_per_token_s[, predict_prefill_s]) of predictors
    # whose host work differs from the cross-layer gate's (predict_s above), each measured on its own: all of the
    # work the predictor adds to an experts call beyond the gate preset's bookkeeping, per prediction

    def __post_init__(self) -> None:
        for f in fields(self):
            if (f.name in ("name", "source", "read_host_s", "read_host_busy_s", "predictors") or f.name in _SLOWDOWNS
                    or (f.name in _OPTIONAL and getattr(self, f.name) is None)):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"ComputeProfile {self.name!r}: {f.name}={v!r} s; give a finite number of "
                                 "seconds >= 0")
        if self.reader_overlap < 1:
            raise ValueError(f"ComputeProfile {self.name!r}: reader_overlap={self.reader_overlap!r}; more readers "
                             "never read slower than one in this model: give a number >= 1 (1: reads one at a time)")
        if self.busy_factor < 1:
            raise ValueError(f"ComputeProfile {self.name!r}: busy_factor={self.busy_factor!r}; a busy link can "
                             "only slow the compute thread down: give a number >= 1 (1: no slow-down)")
        for name in _SLOWDOWNS:
            v = getattr(self, name)
            if not isinstance(v, tuple) or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                               or not math.isfinite(x) or x < 1 for x in v):
                raise ValueError(f"ComputeProfile {self.name!r}: {name}={v!r}; busy readers can only slow the compute "
                                 "thread down: give a tuple of numbers >= 1, one per reader thread")
        for name in ("read_host_s", "read_host_busy_s"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, tuple) or len(v) != 2 or any(
                    isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0
                    for x in v)):
                raise ValueError(f"ComputeProfile {self.name!r}: {name}={v!r}; give (seconds per read, seconds per "
                                 "byte), both finite and >= 0")
        for row in self.predictors:
            if (not isinstance(row, tuple) or len(row) not in (3, 4) or not isinstance(row[0], str) or any(
                    isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0
                    for x in row[1:3] + tuple(x for x in row[3:] if x is not None))):
                raise ValueError(f"ComputeProfile {self.name!r}: predictors holds {row!r}; give (predictor name, "
                                 "seconds of one decode prediction, seconds per additional token[, seconds of a "
                                 "prefill's at 1 token or None]), times >= 0")
        if self.read_host_s is not None and not self.reader_slowdown:
            raise ValueError(f"ComputeProfile {self.name!r}: read_host_s is set without reader_slowdown; the disk "
                             "model needs both (fit/contention.py measures them together)")
        if self.dense_s + self.expert_s <= 0:
            raise ValueError(f"ComputeProfile {self.name!r}: dense_s and expert_s are both 0, so a forward takes no "
                             "time and tokens/s is undefined; give at least one of them > 0")

    def transfer_extra(self, urgent: bool) -> float:
        """The overshoot the simulator adds to one transfer: a demand load's, or a prefetch's."""
        return self.demand_extra_s if urgent and self.demand_extra_s is not None else self.link_extra_s

    @property
    def disk_model(self) -> bool:
        """True when the simulator charges disk reads and their readers' contention as measured (`read_host_s`)."""
        return self.read_host_s is not None

    def read_host(self, nbytes: int, busy: bool) -> float:
        """A disk read's host work for nbytes (the disk model): alone, or beside the compute thread."""
        per_read, per_byte = (self.read_host_busy_s if busy else self.read_host_s) or (0.0, 0.0)
        return per_read + per_byte * nbytes

    def slowdown(self, readers: int, dense: bool = False, prefill: bool = False, predict: bool = False) -> float:
        """The compute thread's slow-down with `readers` reader threads busy (the deepest measured beyond it), of a
        dense layer or of an experts call's piece (`predict`: a prediction), in a decode step or a prefill (where
        measured apart)."""
        f = self.reader_slowdown
        if dense:
            f = self.reader_slowdown_dense or f
        if prefill:
            f = ((self.reader_slowdown_prefill_dense if dense else ())
                 or (self.reader_slowdown_predict_prefill if predict else ()) or self.reader_slowdown_prefill or f)
        if readers <= 0 or not f:
            return 1.0
        return f[min(readers, len(f)) - 1]

    def dense(self, T: int) -> float:
        """One layer's dense compute for T tokens."""
        return self._at(T, self.dense_s, self.dense_prefill_s) + self.dense_per_token_s * (T - 1)

    def expert(self, n: int, T: int = 1) -> float:
        """One expert's compute on n tokens, in a step of T tokens (T > 1: a prefill's code)."""
        return self._at(T, self.expert_s, self.expert_prefill_s) + self.expert_per_token_s * (n - 1)

    def call(self, T: int) -> float:
        """The experts call's own bookkeeping in a step of T tokens."""
        return self._at(T, self.call_s, self.call_prefill_s) + self.call_per_token_s * (T - 1)

    @staticmethod
    def _at(T: int, decode: float, prefill: float | None) -> float:
        return prefill if T > 1 and prefill is not None else decode

    def predict(self, T: int, predictor: str | None = None) -> float:
        """One host-side prediction for T tokens (by `predictor` where it was measured apart, else the gate's)."""
        for name, s, per_token, *prefill in self.predictors:
            if name == predictor:
                return self._at(T, s, prefill[0] if prefill else None) + per_token * (T - 1)
        return self._at(T, self.predict_s, self.predict_prefill_s) + self.predict_per_token_s * (T - 1)

    def decode_layer_s(self, top_k: int) -> float:
        """One MoE decoder layer of a decode token with top_k experts computed: the clock a scaled link keeps."""
        return self.dense_s + top_k * self.expert_s + self.call_s
