"""The speed and memory of a statically placed deployment, from bytes, FLOPs and data sheets: no trace needed.

What this file is: `Deployment` (a model's weights at a format, a placement, a device, a host, an engine, the
link and the disk) and `predict(d)` -> `StaticPrediction`: the bytes on the GPU and in host RAM, whether they fit,
and the predicted decode tok/s, prefill tok/s and time to first token, with what bounds each. A statically
placed decode token reads exactly its own top-k experts in every MoE layer, so its time follows from bytes:

    decode token = sum over layers of  bytes read on the GPU / (GPU bandwidth x its efficiency)
                                    +  bytes read by the CPU / (the engine's CPU bandwidth on this host)
                                    +  bytes not resident in RAM / (the disk's rate at its read-ahead window)
                                    +  the engine's fixed time per layer (+ a hop where experts run on the CPU)

A prompt runs in batches of `UBATCH` tokens: the GPU's layers at the larger of their bytes and their FLOPs; the
CPU-placed weights either cross the link to the GPU each batch (llama.cpp's op offload, from 32 tokens) or are
computed on the CPU at its FLOP rate. Attention's own FLOPs (growing with the context) are left out: a prompt
of a few thousand tokens is dominated by the weights.
What it is not: the runtime presets (prefetching, caching: the timed simulator with a trace) or a measurement.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fate_lab.hardware.devices import DeviceSpec
from fate_lab.hardware.disks import READAHEAD_BYTES
from fate_lab.hardware.engines import PREFILL_STREAM_MIN_BATCH, UBATCH, Engine
from fate_lab.hardware.formats import WeightFormat
from fate_lab.hardware.host_specs import HostSpec
from fate_lab.hardware.links import LINK_PROFILES, LinkProfile
from fate_lab.hardware.params import ModelParams
from fate_lab.hardware.placements import Placement

GPU_RESERVED_BYTES = 0.35 * 2**30  # the CUDA context and the runtime's own allocations (estimate: ~300-400 MiB
# reported by nvidia-smi for an idle CUDA context on Ampere/Ada)
OS_RESERVED_BYTES = 2 * 2**30  # RAM the OS and the engine's own buffers keep from the page cache (estimate)
FIT_MARGIN_BYTES = 2**30  # free device memory `--fit` leaves: llama.cpp's --fit-target default, 1024 MiB


@dataclass(frozen=True)
class Deployment:
    """One statically placed deployment."""

    params: ModelParams
    fmt: WeightFormat
    placement: Placement
    device: DeviceSpec | None  # None: no GPU at all
    host: HostSpec
    engine: Engine
    link: LinkProfile | None  # host -> GPU (None: the device's own host link; unused on unified memory)
    disk: LinkProfile | None = None
    gpus: int = 1  # identical cards splitting the layers (llama.cpp's default --split-mode layer)
    context: int = 4096  # tokens of KV cache reserved
    prompt: int = 512  # tokens of the prompt (the KV a decode token reads, the batches of the prefill)
    budget_bytes: float | None = None  # device memory the deployment may use; None: every card's memory


@dataclass
class StaticPrediction:
    """What one static deployment needs and how fast it runs."""

    flags: str
    gpu_bytes: float
    cpu_bytes: float
    budget_bytes: float
    ram_bytes: float | None
    fits: bool
    why: str  # "" when it fits; else the numbers
    decode_tok_s: float | None
    prefill_tok_s: float | None
    ttft_s: float | None
    decode_bound: str
    resident_share: float  # of the CPU-placed bytes, the share host RAM holds
    parts_ms: dict = field(default_factory=dict)  # decode ms per token by part

    def row(self) -> dict:
        """One table row (GiB, tok/s; None where it does not fit)."""
        return {"flags": self.flags, "GPU (GiB)": self.gpu_bytes / 2**30, "host RAM (GiB)": self.cpu_bytes / 2**30,
                "fits": self.fits, "decode tok/s": self.decode_tok_s, "prefill tok/s": self.prefill_tok_s,
                "TTFT (ms)": None if self.ttft_s is None else 1e3 * self.ttft_s, "decode bound": self.decode_bound,
                "why not": self.why}


def _compute_buffer(p: ModelParams) -> float:
    """The engine's activation buffers for one UBATCH: logits (vocab) and a few hidden-wide tensors in fp32."""
    vocab = (p.head or p.embed) // max(1, p.hidden)
    return UBATCH * 4 * (vocab + 8 * p.hidden)


def memory(d: Deployment) -> tuple[float, float]:
    """(device bytes, host bytes) of a deployment: weights where the placement puts them, the KV cache with its
    layer, the buffers on the device."""
    p, fmt = d.params, d.fmt
    lay = d.placement.layout(p.n_layers)
    gpu = cpu = 0.0
    has_gpu = d.device is not None and not d.placement.cpu_only
    for i, (dense_gpu, exp_gpu) in enumerate(lay.layers):
        dense = p.dense_bytes(fmt, i) + p.layers[i].kv_bytes_per_token * d.context
        experts = p.layers[i].experts * p.expert_bytes(fmt, i)
        on_gpu = has_gpu and dense_gpu
        gpu += dense * on_gpu + experts * (has_gpu and exp_gpu)
        cpu += dense * (not on_gpu) + experts * (not (has_gpu and exp_gpu))
    head = p.head_bytes(fmt) if p.head else 0.0
    if has_gpu and lay.head_on_gpu:
        gpu += head
    else:
        cpu += head
    cpu += p.embed_bytes(fmt)
    if has_gpu:
        gpu += GPU_RESERVED_BYTES * d.gpus + _compute_buffer(p)
    if d.device is not None and d.device.unified:
        return gpu + cpu, 0.0
    return gpu, cpu


def _readahead(d: Deployment) -> int:
    return int(getattr(d.disk, "readahead", READAHEAD_BYTES))


def _disk_bandwidth(d: Deployment) -> float:
    """The disk's rate for faults on a mapping: one read per read-ahead window, one fault in flight per core (a
    faulting thread waits for its read)."""
    if d.disk is None:
        return 0.0
    qd = min(d.disk.queue_depth, d.host.cores * d.host.sockets)
    return dataclasses.replace(d.disk, queue_depth=max(1, qd)).stream_bandwidth(_readahead(d))


def mmap_read_bytes(nbytes: float, readahead: int) -> float:
    """Bytes the kernel reads to fault in one contiguous run of nbytes (one expert) through a mapping: the first
    fault's window is centred on it (half of it before the run, `disks.READAHEAD_BYTES`), later windows follow
    the run; a run smaller than a window costs the whole window."""
    return max(float(readahead), nbytes + readahead / 2)


def predict(d: Deployment) -> StaticPrediction:
    """Memory, fit and speed of one deployment (module docstring)."""
    p, fmt, eng = d.params, d.fmt, d.engine
    lay = d.placement.layout(p.n_layers)
    gpu_bytes, cpu_bytes = memory(d)
    has_gpu = d.device is not None and not d.placement.cpu_only
    unified = d.device is not None and d.device.unified
    budget = d.budget_bytes if d.budget_bytes is not None else (
        d.device.memory_gib * 2**30 * d.gpus if d.device is not None else 0.0)
    ram = d.host.ram_bytes()
    why = ""
    if has_gpu and gpu_bytes > budget:
        why = (f"needs {gpu_bytes / 2**30:.1f} GiB of device memory, {budget / 2**30:.1f} GiB allowed "
               f"({d.gpus} x {d.device.name})")
    resident = 1.0
    if ram is not None and cpu_bytes > 0:
        resident = min(1.0, max(0.0, ram - OS_RESERVED_BYTES) / cpu_bytes)
        if resident < 1.0 and d.disk is None:
            why = why or (f"the CPU-placed weights ({cpu_bytes / 2**30:.1f} GiB) exceed host RAM "
                          f"({ram / 2**30:.0f} GiB) and no --disk holds the rest")
    flags = d.placement.flags(p.n_layers) + ("" if d.gpus == 1 else f" (split over {d.gpus} GPUs)")
    if why:
        return StaticPrediction(flags, gpu_bytes, cpu_bytes, budget, ram, False, why, None, None, None, "",
                                resident)
    gbw = d.device.mem_bandwidth * d.device.bw_efficiency if d.device is not None else 0.0
    cbw = eng.cpu_bandwidth(d.host.socket_bandwidth(), d.host.sockets, d.host.cores)
    t = dict(gpu=0.0, cpu=0.0, disk=0.0, fixed=0.0)
    cpu_read = 0.0
    cpu_faulted = 0.0  # bytes the disk reads for the CPU's share when none is resident (mmap_read_bytes)
    for i, (dense_gpu, exp_gpu) in enumerate(lay.layers):
        lp = p.layers[i]
        dense = p.dense_bytes(fmt, i) + lp.kv_bytes_per_token * d.prompt
        experts = min(p.top_k, lp.experts) * p.expert_bytes(fmt, i)
        on_gpu = unified or (has_gpu and dense_gpu)
        if on_gpu:
            t["gpu"] += dense / gbw
        else:
            cpu_read += dense
            cpu_faulted += dense
        if unified or (has_gpu and exp_gpu):
            t["gpu"] += experts / gbw
        else:
            cpu_read += experts
            cpu_faulted += min(p.top_k, lp.experts) * mmap_read_bytes(p.expert_bytes(fmt, i), _readahead(d))
        hop = eng.hop_s if on_gpu and not unified and lp.experts and not exp_gpu else 0.0
        t["fixed"] += eng.layer_time(d.host.ghz) + hop
    head = p.head_bytes(fmt)
    if unified or (has_gpu and lay.head_on_gpu):
        t["gpu"] += head / gbw
    else:
        cpu_read += head
        cpu_faulted += head
    t["cpu"] += cpu_read * resident / cbw
    if resident < 1.0:  # the page cache holds `resident` of every piece (no routing locality: a static plan)
        t["disk"] += cpu_faulted * (1 - resident) / _disk_bandwidth(d)
    decode_s = sum(t.values())
    bound = {"gpu": "GPU memory bandwidth", "cpu": "CPU memory bandwidth" if cbw < eng.cpu_core_bps * d.host.cores
             * d.host.sockets * 0.999 else "CPU cores", "disk": "disk reads", "fixed": "per-layer fixed costs"}[
        max(t, key=t.get)]
    ttft = _prefill_s(d, lay, has_gpu, unified, resident, gbw, cbw)
    return StaticPrediction(flags, gpu_bytes, cpu_bytes, budget, ram, True, "", 1.0 / decode_s,
                            d.prompt / ttft, ttft, bound, resident, {k: 1e3 * v for k, v in t.items()})


def _prefill_s(d: Deployment, lay, has_gpu: bool, unified: bool, resident: float, gbw: float, cbw: float) -> float:
    """Seconds for the prompt: batches of UBATCH tokens (module docstring)."""
    p, fmt, eng = d.params, d.fmt, d.engine
    grate = d.device.fp16_flops * d.device.compute_efficiency if d.device is not None else 0.0
    crate = d.host.flops(d.host.sockets) * eng.cpu_flops_eff
    link = d.link or (LINK_PROFILES.get(d.device.host_link) if d.device is not None else None)
    link_bw = link.bandwidth if link is not None else 0.0
    disk_bw = _disk_bandwidth(d) if resident < 1.0 else 0.0
    ra = _readahead(d)
    total, left = 0.0, d.prompt
    while left > 0:
        u = min(UBATCH, left)
        left -= u
        stream = has_gpu and not unified and eng.prefill_stream and u >= PREFILL_STREAM_MIN_BATCH
        for i, (dense_gpu, exp_gpu) in enumerate(lay.layers):
            lp = p.layers[i]
            eb = p.expert_bytes(fmt, i)
            pieces = [(p.dense_bytes(fmt, i), p.dense_bytes(fmt, i), 2.0 * lp.dense_params() * u,
                       unified or (has_gpu and dense_gpu)),
                      (lp.experts * eb, lp.experts * mmap_read_bytes(eb, ra) if eb else 0.0,
                       2.0 * lp.expert_params() * min(lp.experts, p.top_k) * u, unified or (has_gpu and exp_gpu))]
            for nbytes, faulted, flops, on_gpu in pieces:
                if nbytes == 0:
                    continue
                if on_gpu:
                    total += max(nbytes / gbw, flops / grate)
                elif stream:  # the weights cross the link (from disk first where RAM does not hold them)
                    total += nbytes / link_bw + flops / grate + (faulted * (1 - resident) / disk_bw if disk_bw else 0)
                else:
                    total += max(nbytes * resident / cbw + (faulted * (1 - resident) / disk_bw if disk_bw else 0),
                                 flops / crate)
            total += eng.layer_time(d.host.ghz)
        total += p.head_bytes(fmt) / (gbw if has_gpu and lay.head_on_gpu else cbw)
    return total
