"""The host CPU as a place to compute experts: its profiles and the time one expert call takes there.

What this file is: named `HostProfile`s (the CPU of an edge or desktop machine: effective memory
bandwidth, effective FLOP/s, and the fixed cost of one host call: moving the token activations
to the host and back plus the synchronisation) and `HostTime`, the seconds one routed expert
takes on the host for n tokens, either for the model itself or *scaled* like a scaled link: the
time a real setup's expert takes on that CPU, on this run's clock (`setups.py` applies the one scaling rule).
Fiddler, kTransformers, DAOP and llama.cpp's `--n-cpu-moe` compute experts where their weights
live; `policy/placement.py` decides which experts do, the runtime runs them, the simulator
charges this time.

One expert on n tokens reads its weights once and does n x 2 x 3HI FLOPs: a decode token is
bandwidth-bound (bytes / bandwidth), a long prefill step compute-bound (n x FLOPs / FLOP/s).
What it is not: a benchmark. The numbers below are OUR estimates, each derived in a comment.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fate_lab.hardware.host_specs import HOSTS


@dataclass(frozen=True)
class HostProfile:
    """A host CPU computing routed experts from its own memory."""

    name: str
    bandwidth: float  # bytes/s a multi-threaded GEMV streams expert weights at (effective, not peak)
    flops: float  # FLOP/s of a multi-threaded GEMM on the expert's dtype (effective)
    call_s: float  # per expert call: activations to the host and back, thread wake-up, synchronisation
    source: str = ""
    ghz: float | None = None  # the all-core clock (host_specs.py): scales the runtime's measured host time (None:
    # the test machine's clock, engines.FATE_LAB_HOST_GHZ)

    def __post_init__(self) -> None:
        for field, unit in (("bandwidth", "bytes/s"), ("flops", "FLOP/s")):
            v = getattr(self, field)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"HostProfile {self.name!r}: {field}={v!r} {unit}; give a finite number > 0")
        if not (isinstance(self.call_s, (int, float)) and math.isfinite(self.call_s) and self.call_s >= 0):
            raise ValueError(f"HostProfile {self.name!r}: call_s={self.call_s!r} s; give a finite number >= 0")
        ghz = self.ghz
        if ghz is not None and not (isinstance(ghz, (int, float)) and math.isfinite(ghz) and ghz > 0):
            raise ValueError(f"HostProfile {self.name!r}: ghz={self.ghz!r}; give the core clock in GHz, > 0")

    def expert_s(self, nbytes: int, flops_per_token: float, n: int) -> float:
        """Seconds for one expert of nbytes (flops_per_token FLOPs per token) on n tokens."""
        return self.call_s + max(nbytes / self.bandwidth, n * flops_per_token / self.flops)

    def describe(self) -> str:
        """One line for tables: name, bandwidth, FLOP/s and call cost."""
        return (f"{self.name} ({self.bandwidth / 1e9:.3g} GB/s, {self.flops / 1e9:.0f} GFLOP/s, "
                f"{self.call_s * 1e6:.0f} us/call)")


# Effective numbers for fp16/bf16 expert GEMV/GEMM with AVX2/AVX-512 or NEON kernels (llamafile-class,
# as kTransformers and llama.cpp use): a decode GEMV reaches ~60-70% of the DRAM peak; a GEMM ~40-50% of
# the FP32-FMA peak after converting fp16 weights. call_s: two ~10 us PCIe copies of the activations plus
# ~10-20 us of thread wake-up and stream synchronisation (Fiddler reports tens of microseconds per call).
HOST_PROFILES: dict[str, HostProfile] = {
    # 16-core desktop (Ryzen 9 5950X class), dual-channel DDR4-3200: 51.2 GB/s peak; 16 x 2 FMA x 8 x 2 x 3.4 GHz
    # ~ 1.7 TFLOP/s FP32 peak
    "desktop_ddr4": HostProfile("desktop CPU, 16 cores, 2ch DDR4-3200", 35e9, 700e9, 30e-6,
                                "51.2 GB/s peak x ~0.7; ~1.7 TFLOP/s FP32 peak x ~0.4"),
    # 8-core laptop (Ryzen 7 7840HS / Core Ultra 7 class), dual-channel DDR5-5600: 89.6 GB/s peak
    "laptop_ddr5": HostProfile("laptop CPU, 8 cores, 2ch DDR5-5600", 55e9, 350e9, 40e-6,
                               "89.6 GB/s peak x ~0.6; ~0.9 TFLOP/s FP32 peak x ~0.4"),
    # 32-core server (EPYC 9354 class), 12ch DDR5-4800: 460 GB/s peak; kTransformers' target machine
    "server_ddr5": HostProfile("server CPU, 32 cores, 12ch DDR5-4800", 250e9, 2.5e12, 30e-6,
                               "460 GB/s peak x ~0.55 (NUMA); ~5 TFLOP/s AVX-512 peak x ~0.5"),
    # Jetson AGX Orin: 12 Cortex-A78AE sharing LPDDR5 (204.8 GB/s) with the GPU; the CPU cluster reaches
    # ~60 GB/s; 12 x 2 x 4 x 2 x 2.2 GHz ~ 0.4 TFLOP/s FP32 (NEON)
    "orin_cpu": HostProfile("Jetson AGX Orin CPU, 12 Cortex-A78AE", 60e9, 200e9, 40e-6,
                            "CPU cluster share of 204.8 GB/s LPDDR5; ~0.4 TFLOP/s NEON peak x ~0.5"),
    # The hosts of published offloading figures (peak = channels x 8 B x MT/s; the 0.5 efficiency for fp16/bf16
    # expert GEMVs is OUR starting estimate: 4-bit GGUF kernels reach 0.23-0.33 of peak in kTransformers'
    # and ik_llama.cpp's reports, which include the dequantize; no bf16 measurement was found)
    "xeon_gold_6454s": HostProfile("Xeon Gold 6454S, 32 cores, 8ch DDR5-4800 (one socket)", 0.5 * 307.2e9,
                                   0.4 * 65.5e12, 30e-6,
                                   "kTransformers' DeepSeek-V3 host; 307.2 GB/s peak; AMX BF16 65.5 TFLOP/s peak"),
    "threadripper_pro_5975wx": HostProfile("Threadripper PRO 5975WX, 32 cores, 8ch DDR4-3200", 0.5 * 204.8e9,
                                           0.4 * 3.69e12, 30e-6, "ik_llama.cpp gpt-oss-120b host; 204.8 GB/s peak"),
    "i9_10900x": HostProfile("Core i9-10900X, 10 cores, 4ch DDR4", 0.5 * 102e9, 0.4 * 1.9e12, 30e-6,
                             "llmfit --n-cpu-moe reports; 102 GB/s measured by the reporter; AVX-512 ~1.9 TFLOP/s"),
    "i9_9900x": HostProfile("Core i9-9900X, 10 cores, 4ch DDR4-2666", 0.5 * 85.3e9, 0.4 * 2.24e12, 30e-6,
                            "the Fate paper's RTX 3090 host; 85.3 GB/s peak"),
    "epyc_7742": HostProfile("EPYC 7742, 64 cores, 8ch DDR4-3200", 0.5 * 204.8e9, 0.4 * 4.6e12, 30e-6,
                             "Krasis' host; 204.8 GB/s peak; AVX2 ~4.6 TFLOP/s"),
}
_ORIN_GHZ = 2.2  # Jetson AGX Orin 64GB: Cortex-A78AE up to 2.2 GHz (NVIDIA Jetson AGX Orin data sheet)
HOST_PROFILES = {k: dataclasses.replace(p, ghz=HOSTS[k].ghz if k in HOSTS else _ORIN_GHZ)
                 for k, p in HOST_PROFILES.items()}  # each profile's clock, from its host spec


def host_profile(name: str) -> HostProfile:
    """The profile named `name` (clear error for an unknown one)."""
    if name not in HOST_PROFILES:
        raise ValueError(f"unknown host profile {name!r}; choose one of {sorted(HOST_PROFILES)}")
    return HOST_PROFILES[name]


@dataclass(frozen=True)
class HostTime:
    """Seconds one routed expert takes on the host for n tokens: `HostTime(...)(n)`.

    `expert_bytes`/`flops_per_token` describe the expert whose time is charged: the model's own, or a
    real setup's when a small model stands in for it; `scale` maps that time onto this run's clock
    (`setups.Setup.on_clock`; 1.0 otherwise).
    """

    profile: HostProfile
    expert_bytes: int
    flops_per_token: float
    scale: float = 1.0

    def __call__(self, n: int) -> float:
        return self.scale * self.profile.expert_s(self.expert_bytes, self.flops_per_token, n)
