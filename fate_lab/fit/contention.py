"""What the disk's reader threads and the compute thread cost each other on this machine, each measured on its own.

What this file is: `measure_contention(model, prompt_ids)`, which offloads the model with every expert resident
and `link="disk"` (at full precision, then packed as `lru_quant` holds them), then times, in short interleaved trials:
  - one reader thread reading experts with O_DIRECT (`DiskEngine.load_now`: the read, its digest check, the
    conversion and the copy into a slot) while nothing else runs, and while the model decodes beside it;
  - the model's decode forwards alone, and beside one and two reader threads that read without a pause; then its
    prefill forwards likewise (a prefill's experts calls run other code, on more rows per expert).
A reader rewrites an expert into its own slot (the same bytes), so the model computes exactly as it would.
The result (`Contention`) gives the simulator (`sim/simulate.py`, a disk link) what no single run shows: a read's
host work beyond the disk's own latency + bytes / bandwidth, with the compute thread waiting and beside it (a line
through the full and the packed read: much of it is per read, not per byte), and
how much slower the compute thread runs with 1, 2, ... readers busy. On the 2-core test machine one busy reader
made `tiny_deepseek`'s decode experts calls 3.0-3.2x slower and two 5.3-5.9x (three calibrations in a row, after
the readers were made to outlast the last forward of each trial: 4.1-5.0x before); the readers share one
interpreter lock and the two cores.
What it is not: the disk's latency and bandwidth (`fit/disk.py` measures those with bare reads) or a benchmark
of any preset (`benchmarks/bench_disk.py`).
"""
from __future__ import annotations

import dataclasses
import random
import statistics
import threading
import time
from dataclasses import dataclass

import torch

TRIAL_S = 0.5  # seconds per trial, at least
MIN_FORWARDS = 6  # forwards per trial, within 4 x TRIAL_S (a tiny_deepseek prefill beside two readers: ~150 ms)
PREFILL_TOKENS = 24  # the prompt of the prefill trials (the disk benchmark's prompts are 24 tokens)
ROUNDS = 4  # interleaved rounds of every trial; each figure is the median over its rounds (reads: all samples)


@dataclass(frozen=True)
class Contention:
    """One expert read (the whole read: disk and host work) alone and beside the compute thread, at full precision
    and packed (`lru_quant`'s INT4 copy, fewer bytes), and the compute thread's slow-down with 1..depth readers busy
    (`slowdown[i]`: i + 1 readers), of its experts calls and of the rest of its forwards apart: the experts calls'
    many small Python-driven pieces suffer more (3.0-3.2x with one reader on `tiny_deepseek`, the rest 2.4-2.6x)."""

    read_idle_s: float
    read_busy_s: float
    slowdown: tuple[float, ...]  # the experts calls' pieces (experts, bookkeeping, prediction)
    slowdown_dense: tuple[float, ...]  # the rest of a decode forward (attention, router, norms, head)
    forward_s: float  # a decode forward alone (what the slow-downs are relative to)
    nbytes: int  # the bytes of a full-precision read, as the runtime counts them
    packed_idle_s: float | None = None  # a packed read (None: the model has no packed copy: no group size fits)
    packed_busy_s: float | None = None
    packed_nbytes: int = 0
    slowdown_prefill: tuple[float, ...] = ()  # the same of a prefill forward's experts calls (empty: not measured)
    slowdown_prefill_dense: tuple[float, ...] = ()  # ... and of the rest of a prefill forward
    overlap: float = 1.0  # reads per second with `depth` readers busy over those with one, compute idle (at least 1):
    # 0.85-0.88 on the embedded models (their reads' host work is small steps under one interpreter lock), 1.60 on the
    # 17.3 MB experts of the larger-than-RAM benchmark (large conversions and copies that release it)

    def host_line(self, latency: float, bandwidth: float, busy: bool) -> tuple[float, float]:
        """(seconds per read, seconds per byte) of a read's host work beyond the disk's latency + bytes / bandwidth:
        the line through the full and the packed read (through the full one and 0 without a packed one)."""
        full = max(0.0, (self.read_busy_s if busy else self.read_idle_s) - latency - self.nbytes / bandwidth)
        packed = self.packed_busy_s if busy else self.packed_idle_s
        if packed is None or self.packed_nbytes >= self.nbytes:
            return 0.0, full / self.nbytes
        small = max(0.0, packed - latency - self.packed_nbytes / bandwidth)
        per_byte = max(0.0, (full - small) / (self.nbytes - self.packed_nbytes))
        return max(0.0, small - per_byte * self.packed_nbytes), per_byte


def _decode_loop(model, ids: torch.Tensor, stop: threading.Event, out: list[float]) -> None:
    """Greedy decode forwards until stop, restarting from the prompt every 32 tokens; each forward's seconds."""
    with torch.no_grad():
        while not stop.is_set():
            o = model(input_ids=ids, use_cache=True)
            for _ in range(32):
                if stop.is_set():
                    return
                t = time.perf_counter()
                o = model(input_ids=o.logits[:, -1:].argmax(-1), cache=o.cache, use_cache=True)
                out.append(time.perf_counter() - t)


def _prefill_loop(model, ids: torch.Tensor, stop: threading.Event, out: list[float]) -> None:
    """Prefill forwards of the prompt (the last position's logits only, as `generate` computes) until stop."""
    with torch.no_grad():
        while not stop.is_set():
            t = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
            out.append(time.perf_counter() - t)


def _read_loop(engine, pairs, seed: int, stop: threading.Event, out: list[float]) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        m, e, slot, spec = pairs[rng.randrange(len(pairs))]
        out.append(engine.load_now(m, e, slot, spec))


def _trial(rt, pairs, model, ids, readers: int, compute: bool, phase: str = "decode") -> tuple[list[float], float,
                                                                                             float]:
    """(read seconds, experts-call seconds per forward, other seconds per forward) of one trial, with decode or
    prefill (`phase`) forwards computing: the first reads of each thread are left out (warm-up); the forwards'
    split comes from the runtime's own stats. The trial lasts `TRIAL_S`, and up to 4 x `TRIAL_S` for `MIN_FORWARDS`
    forwards; the readers stop only once the compute thread has finished its last forward, so that every forward
    timed ran beside them from its start to its end (stopping both at once left the last forward partly alone: with
    three 150 ms prefill forwards a trial, that understated the slow-down by about a sixth)."""
    stop_compute, stop_reads = threading.Event(), threading.Event()
    reads: list[list[float]] = [[] for _ in range(readers)]
    fwd: list[float] = []
    threads = [threading.Thread(target=_read_loop, args=(rt.engine, pairs, i, stop_reads, reads[i]), daemon=True)
               for i in range(readers)]
    worker = None
    if compute:
        loop, args = (_decode_loop, ids[:, :16]) if phase == "decode" else (_prefill_loop, ids)
        worker = threading.Thread(target=loop, args=(model, args, stop_compute, fwd), daemon=True)
    rt.reset_stats()
    for t in threads + ([worker] if worker else []):
        t.start()
    time.sleep(TRIAL_S)
    deadline = time.perf_counter() + 3 * TRIAL_S  # a model too slow for MIN_FORWARDS (seconds a forward) ends soon
    while worker is not None and len(fwd) < MIN_FORWARDS and time.perf_counter() < deadline:
        time.sleep(0.01)
    stop_compute.set()
    if worker is not None:
        worker.join()
    stop_reads.set()
    for t in threads:
        t.join()
    calls = other = float("nan")
    fw = rt.stats.forward_s[phase]
    if compute and fw:
        calls = rt.stats.total(phase).compute_s / len(fw)
        other = sum(fw) / len(fw) - calls
    return [x for r in reads for x in r[2:]], calls, other


def _measure(model, ids, preset: str, kinds: list[tuple], rounds: int = ROUNDS) -> tuple[dict, int]:
    """Each (readers, compute[, phase]) trial's results over `rounds` interleaved rounds, with `preset`'s every expert
    resident read back into its own slot (the same bytes, at the slot's precision); and the bytes of one read."""
    from fate_lab.core.config import OffloadConfig
    from fate_lab.offloading.runtime import offload

    cfg = OffloadConfig.preset(preset, all_resident=True, link="disk", store="ssd", checkpoint=model.name_or_path)
    samples: dict[tuple, list[tuple[list[float], float, float]]] = {}
    with offload(model, cfg) as rt:
        pairs = [(m, e, slot, rt.core.spec(m, "cache")) for m, layer in enumerate(rt.cache.layers)
                 for e, slot in layer.where.items()]
        if not pairs:
            raise RuntimeError("no expert is resident after an all-resident offload (a bug)")
        nbytes = rt.core.shape.nbytes(pairs[0][3])
        _trial(rt, pairs, model, ids, 1, True)  # warm-up: first forwards allocate, first reads fault in
        for _ in range(rounds):
            for k in kinds:
                samples.setdefault(k, []).append(_trial(rt, pairs, model, ids, *k))
    return samples, nbytes


def _packable(model) -> bool:
    """Can a quantized preset pack this model's experts (a group size of INT4 divides their projections' last dims,
    as `fit/calibrate._dequant_s` asks)?"""
    from fate_lab.model.adapters import adapt

    w = adapt(model).expert(0, 0)
    return any(w.gate_up.shape[-1] % g == 0 and w.down.shape[-1] % g == 0 for g in (64, 32, 16, 8))


def available_bytes() -> int | None:
    """Memory the kernel can give this process now (MemAvailable of /proc/meminfo); None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_memory(model) -> None:
    """The trials hold every expert resident, in slots beside the model's own weights: refuse, with the figures, a
    model whose experts do not fit in the memory available now (a model larger than its RAM budget), rather than
    be killed by the kernel half-way (which loses the whole process)."""
    from fate_lab.model.adapters import adapt

    a = adapt(model)
    need = a.num_moe_layers * a.num_experts * a.expert(0, 0).nbytes()
    avail = available_bytes()
    if avail is not None and need > 0.9 * avail:
        raise MemoryError(
            f"the disk's contention trials hold every expert of this model resident ({need / 1e9:.2f} GB of slots), "
            f"but only {avail / 1e9:.2f} GB of memory is available now: a model larger than its RAM budget cannot be "
            "calibrated this way yet. Predict it with a disk link profile and a compute profile calibrated on a "
            "model that fits (fate_lab.study.whatif.machine_hardware on a smaller model of the family)")


def measure_contention(model, prompt_ids: torch.Tensor, depth: int = 2, rounds: int = ROUNDS) -> Contention:
    """Measure `Contention` on this machine for `model` (loaded from its checkpoint folder, which the reads use)
    with up to `depth` reader threads (the disk link's queue depth), each trial repeated in `rounds` interleaved
    rounds (1: a rougher profile in a quarter of the time, what FAST mode asks). Torch's thread count is the
    caller's."""
    if depth < 1:
        raise ValueError(f"depth={depth!r}: give at least one reader thread")
    if rounds < 1:
        raise ValueError(f"rounds={rounds!r}: give at least one round of the trials")
    _check_memory(model)
    ids = prompt_ids[:, :PREFILL_TOKENS]
    kinds = [(0, True), (1, False)] + [(r, True) for r in range(1, depth + 1)]
    kinds += [(r, True, "prefill") for r in range(depth + 1)] + ([(depth, False)] if depth > 1 else [])
    full, nbytes = _measure(model, ids, "lru", kinds, rounds)
    med = statistics.median

    def reads(k):
        return med([x for r in full[k] for x in r[0]])

    def part(k, i):
        return med([r[i] for r in full[k]])

    calls, other = part((0, True), 1), part((0, True), 2)
    out = Contention(read_idle_s=reads((1, False)), read_busy_s=reads((1, True)),
                     slowdown=tuple(max(1.0, part((r, True), 1) / calls) for r in range(1, depth + 1)),
                     slowdown_dense=tuple(max(1.0, part((r, True), 2) / other) for r in range(1, depth + 1)),
                     forward_s=calls + other, nbytes=nbytes,
                     overlap=max(1.0, depth * reads((1, False)) / reads((depth, False))) if depth > 1 else 1.0)
    p_calls, p_other = part((0, True, "prefill"), 1), part((0, True, "prefill"), 2)
    out = dataclasses.replace(
        out, slowdown_prefill=tuple(max(1.0, part((r, True, "prefill"), 1) / p_calls) for r in range(1, depth + 1)),
        slowdown_prefill_dense=tuple(max(1.0, part((r, True, "prefill"), 2) / p_other) for r in range(1, depth + 1)))
    if not _packable(model):
        return out
    packed, pbytes = _measure(model, ids, "lru_quant", [(1, False), (1, True)], rounds)
    return dataclasses.replace(out, packed_idle_s=med([x for r in packed[1, False] for x in r[0]]),
                               packed_busy_s=med([x for r in packed[1, True] for x in r[0]]), packed_nbytes=pbytes)
