"""Inference engines as data: how much of the hardware each one's kernels reach, and what each call costs.

What this file is: `Engine` (the efficiency of its CPU expert kernels against the socket's peak DRAM bandwidth,
the most one core's kernel streams, what a second socket adds, its per-layer fixed time on the GPU and per
CPU-expert hop, its CPU GEMM efficiency in prefill, and whether it streams CPU-placed weights to the GPU for a
prompt's batches), `ENGINES` and `engine(name)`. Every constant names its source: a data sheet, the project's
own measurement, an estimate (said so), or the ONE published figure it was calibrated on (`calibrated_on`:
that figure is then marked "calibration" in docs/published_vs_predicted.md and left out of the held-out score).
What it is not: the speed model (`static_speed.py`) or the runtime presets' simulator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

FATE_LAB_CALL_S = 78e-6  # fate_lab's host time per experts call without a prediction (lru; plain transformers 92 us)
FATE_LAB_PREDICT_S = 22e-6  # ... what fate's host-side cross-layer prediction adds to it (fate 100 us - lru 78 us)
# Both measured by benchmarks/bench_host_path.py (benchmarks/results/host_path_2026-12-04.md: hooks on a tiny random
# Qwen2-MoE, 8 MoE layers, every expert cached, one torch thread) on the 2-core AMD EPYC of the test machine, and
# scaled to another host by its clock (FATE_LAB_HOST_GHZ below). The simulator's roofline (roofline.py) and plan's
# fate_lab engine read them. ONE place: update it when the runtime's call changes.
FATE_LAB_MOE_CALL_S = FATE_LAB_CALL_S + FATE_LAB_PREDICT_S  # fate's whole call, prediction included: 100 us
FATE_LAB_HOST_GHZ = 2.6  # the core clock of the CPU those were measured on: "AMD EPYC", CPU family 25 model 17 (Zen 4,
# EPYC 9004), 2596 MHz in /proc/cpuinfo. That host time is one thread of Python and torch dispatch, so on another host
# it is scaled by the clock ratio, FATE_LAB_HOST_GHZ / ghz (`host_time`), with the host's all-core clock from
# host_specs.py. Stated assumption: equal work per cycle (IPC); Zen 3/4 and Ice Lake-Sapphire Rapids cores differ by
# less than 20% per clock, an Arm Cortex-A78 core more (not measured here). Measured against it (2026-12-06,
# benchmarks/results/host_path_2026-12-06.md): on a KVM guest "Intel Xeon" (family 6 model 167) at the same 2.6 GHz
# every call took twice as long on a busy machine, the measuring commit's code alike; on the same guest quiet
# (host_path_2026-12-06_marked_once.md) plain transformers took 1.4x (130-132 us), lru 1.2x (93-94), fate 1.3x
# (126-129): a clock alone can miss a host by 1.2-2x, load included.


def host_time(seconds: float, ghz: float | None, measured_ghz: float = FATE_LAB_HOST_GHZ) -> float:
    """A host time measured on a core of `measured_ghz` (default: the test machine's), on a core running at `ghz`
    (None: the measuring core's own clock, unscaled)."""
    if ghz is None:
        return seconds
    if not (isinstance(ghz, (int, float)) and math.isfinite(ghz) and ghz > 0):
        raise ValueError(f"ghz={ghz!r}: give the host's core clock in GHz, a finite number > 0")
    return seconds * measured_ghz / ghz
HOP_S = 30e-6  # activations GPU->CPU->GPU and a thread-pool wake per CPU-expert layer: two ~10 us copies + ~10 us
# of wake-up and synchronisation (estimate; Fiddler reports tens of microseconds per host call)
PREFILL_STREAM_MIN_BATCH = 32  # llama.cpp's CUDA backend offloads an op on CPU-resident weights to the GPU from
# a batch of 32 tokens (ggml-cuda.cu ggml_backend_cuda_device_offload_op: min_batch_size 32)
UBATCH = 512  # llama.cpp's default physical batch (-ub 512, common/arg.cpp)


@dataclass(frozen=True)
class Engine:
    """One engine's kernel efficiencies and fixed costs."""

    name: str
    cpu_bw_eff: float  # CPU expert GEMV: achieved / peak DRAM bandwidth of one socket (memory-bound)
    cpu_core_bps: float  # bytes/s of weights one core's expert kernel gets through (the compute-bound cap)
    numa_gain: float  # fraction of each further socket's bandwidth decode uses (0: none)
    layer_s: float  # fixed time per decoder layer of a decode token (launches, graph, host bookkeeping)
    hop_s: float  # extra per layer whose routed experts run on the CPU while the rest runs on the GPU
    cpu_flops_eff: float  # CPU GEMMs of a prompt: achieved / peak FP32 FLOP/s
    prefill_stream: bool  # CPU-placed weights cross the link to the GPU for a prompt's batches (op offload)
    layer_s_ghz: float | None = None  # layer_s is host time measured on a core of this clock: scaled by the host's
    # clock (`host_time`); None: a fixed time
    sources: dict = field(default_factory=dict, compare=False)
    calibrated_on: tuple[str, ...] = ()  # published.json ids a constant was fitted to

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "float" and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"Engine {self.name!r}: {f.name}={v!r}; give a finite number >= 0")
        for f in ("cpu_bw_eff", "cpu_flops_eff"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"Engine {self.name!r}: {f}={getattr(self, f)!r}; give a fraction in (0, 1]")

    def layer_time(self, ghz: float | None) -> float:
        """layer_s on a host whose cores run at `ghz`: scaled by the clock ratio where layer_s is measured host
        time (`layer_s_ghz`), else as it is."""
        if self.layer_s_ghz is None:
            return self.layer_s
        return host_time(self.layer_s, ghz, self.layer_s_ghz)

    def cpu_bandwidth(self, socket_bps: float, sockets: int, cores: int) -> float:
        """Bytes/s its CPU expert kernels stream on a host: memory-bound or core-bound, whichever is lower."""
        mem = self.cpu_bw_eff * socket_bps * (1 + self.numa_gain * (sockets - 1))
        return min(mem, self.cpu_core_bps * cores * (1 + self.numa_gain * (sockets - 1)))


_GPU = "PR ggml-org/llama.cpp#16991 table: gpt-oss 20B MXFP4 on an RTX PRO 6000 Blackwell, tg128 391.2 t/s"
ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("llama.cpp", cpu_bw_eff=0.480, cpu_core_bps=3.80e9, numa_gain=0.0, layer_s=26.7e-6, hop_s=HOP_S,
           cpu_flops_eff=0.4, prefill_stream=True,
           sources={"cpu_bw_eff": "calibrated: r/LocalLLaMA 'KTransformers 2.1 and llama.cpp Comparison with "
                                  "DeepSeek V3': llama.cpp CPU-only Q4_K_M, EPYC 7773X, 4.36 t/s",
                    "cpu_core_bps": "calibrated: llmfit PR 755, RTX 2080 + i9-10900X (10 cores), Qwen3-30B-A3B "
                                    "Q4_K_M --n-cpu-moe 36, 36.7 t/s",
                    "numa_gain": "estimate: llama.cpp has no NUMA-aware expert placement; a thread reads the "
                                 "other socket's memory as often as its own",
                    "layer_s": f"calibrated: {_GPU} (bandwidth x 0.75 predicts 1.9 ms a token; the rest over 24 "
                               "layers)", "hop_s": "estimate (HOP_S)",
                    "cpu_flops_eff": "estimate: hosts.py's GEMM ~40% of the FP32 FMA peak",
                    "prefill_stream": "ggml-cuda op offload from 32-token batches (PREFILL_STREAM_MIN_BATCH)"},
           calibrated_on=("localllama_ktrans21_llamacpp_cpu_q4km", "llmfit_qwen3_30b_rtx2080",
                          "llamacpp_pr16991_pro6000_gptoss20b")),
    Engine("ktransformers", cpu_bw_eff=0.480, cpu_core_bps=3.80e9, numa_gain=0.553, layer_s=26.7e-6, hop_s=HOP_S,
           cpu_flops_eff=0.4, prefill_stream=False,
           sources={"cpu_bw_eff": "as llama.cpp: its CPU MoE operator runs llamafile's ggml kernels (kTransformers "
                                  "docs)", "cpu_core_bps": "as llama.cpp (the same kernels)",
                    "numa_gain": "calibrated: kTransformers DeepseekR1_V3_tutorial.md V0.2, dual socket (2 x Xeon Gold "
                                 "6454S), 8 experts, 12.208 t/s",
                    "layer_s": "as llama.cpp (CUDA graphs on the GPU part)", "hop_s": "estimate (HOP_S)",
                    "cpu_flops_eff": "estimate (as llama.cpp)",
                    "prefill_stream": "V0.2 computes a prompt's experts on the CPU"},
           calibrated_on=("ktransformers_v02_dual_socket_8",)),
    Engine("fate_lab", cpu_bw_eff=0.5, cpu_core_bps=3.80e9, numa_gain=0.0, layer_s=FATE_LAB_MOE_CALL_S, hop_s=HOP_S,
           cpu_flops_eff=0.4, prefill_stream=False, layer_s_ghz=FATE_LAB_HOST_GHZ,
           sources={"cpu_bw_eff": "estimate: hosts.py's 0.5 for bf16 expert GEMVs (no measurement found)",
                    "cpu_core_bps": "as llama.cpp (estimate)", "numa_gain": "estimate: no NUMA placement",
                    "layer_s": "measured: FATE_LAB_MOE_CALL_S (bench_host_path) at FATE_LAB_HOST_GHZ, scaled "
                                          "by the host's clock",
                    "hop_s": "estimate (HOP_S)", "cpu_flops_eff": "estimate (as llama.cpp)",
                    "prefill_stream": "host compute runs a prompt's host experts on the CPU"}),
)}


def engine(name: str, flag: str = "--engine") -> Engine:
    """The engine named `name` (one clear line for an unknown one)."""
    if name not in ENGINES:
        raise ValueError(f"{flag} {name!r}: unknown engine; choose one of {', '.join(ENGINES)}")
    return ENGINES[name]


def host_profile_of(spec, eng: Engine):
    """The simulator's `HostProfile` of a host spec under an engine: its CPU bandwidth and GEMM rate, HOP_S a call."""
    from fate_lab.hardware.hosts import HostProfile

    return HostProfile(spec.name, eng.cpu_bandwidth(spec.socket_bandwidth(), spec.sockets, spec.cores),
                       spec.flops(spec.sockets) * eng.cpu_flops_eff, HOP_S, f"{spec.describe()} under {eng.name}",
                       ghz=spec.ghz)
