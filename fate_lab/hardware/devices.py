"""Accelerators as their data sheets describe them: memory bandwidth, dense fp16/bf16 throughput, memory, launch cost.

What this file is: `DeviceSpec` and `DEVICES`, a catalogue of named devices (desktop and laptop GeForce cards,
data-centre A100/H100/L4/T4, a Jetson AGX Orin and Apple M-series unified-memory machines), each number with
its source, plus the two efficiency fractions a roofline applies to them (`roofline.py`). Throughput is the
*dense* tensor rate PyTorch reaches the path to: fp16/bf16 with FP32 accumulation on GeForce (half the
FP16-accumulate headline), dense (never the 2:4-sparsity headline) on data-centre parts.
What it is not: a measurement. The fractions are OUR estimates: large-copy measurements reach 0.74-0.91 of
the data-sheet bandwidth (A100 bandwidthTest 1157/1555, RTX 4090 local copy ~920/1008, cloud T4 240/320);
decode GEMVs on MB-sized experts sit below that, so 0.75; a GEMM at prefill shapes ~0.6 of peak. The launch
cost is an eager-PyTorch op, ~5 us (raw cuLaunchKernel 1.3 us; a CUDA-graph replay 1.1-1.5 us per kernel).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BW_EFFICIENCY = 0.75  # achieved / data-sheet memory bandwidth for weight streaming (module docstring)
COMPUTE_EFFICIENCY = 0.6  # achieved / dense peak for GEMMs at prefill shapes (estimate)
EAGER_LAUNCH_S = 5e-6  # one eager PyTorch kernel launch on a discrete GPU (estimate)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: what its data sheet says, and how much of it a roofline assumes is reached."""

    name: str
    mem_bandwidth: float  # bytes/s, data sheet
    fp16_flops: float  # FLOP/s, dense fp16/bf16 tensor rate on PyTorch's accumulate path
    memory_gib: float  # device memory (unified: shared with the CPU)
    host_link: str  # the `links.LINK_PROFILES` key of its usual host link ("unified": none, same DRAM)
    launch_s: float = EAGER_LAUNCH_S
    bw_efficiency: float = BW_EFFICIENCY
    compute_efficiency: float = COMPUTE_EFFICIENCY
    unified: bool = False  # CPU and accelerator share one memory (Jetson, Apple): no host-to-device copy
    source: str = ""

    def __post_init__(self) -> None:
        for f, unit in (("mem_bandwidth", "bytes/s"), ("fp16_flops", "FLOP/s"), ("memory_gib", "GiB")):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"DeviceSpec {self.name!r}: {f}={v!r} {unit}; give a finite number > 0")
        for f in ("bw_efficiency", "compute_efficiency"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"DeviceSpec {self.name!r}: {f}={v!r}; give a fraction in (0, 1]")
        if not (isinstance(self.launch_s, (int, float)) and math.isfinite(self.launch_s) and self.launch_s >= 0):
            raise ValueError(f"DeviceSpec {self.name!r}: launch_s={self.launch_s!r} s; give a finite number >= 0")

    def read_s(self, nbytes: float) -> float:
        """Seconds to stream nbytes of weights at the achieved bandwidth."""
        return nbytes / (self.mem_bandwidth * self.bw_efficiency)

    def compute_s(self, flops: float) -> float:
        """Seconds for flops at the achieved dense rate."""
        return flops / (self.fp16_flops * self.compute_efficiency)

    def describe(self) -> str:
        """One line: name, bandwidth, throughput, memory."""
        return (f"{self.name} ({self.mem_bandwidth / 1e9:.0f} GB/s, {self.fp16_flops / 1e12:.0f} TFLOP/s fp16, "
                f"{self.memory_gib:g} GiB)")


GB, TF = 1e9, 1e12
_GA102 = "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"
_ADA = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
_A100 = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100 = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
DEVICES: dict[str, DeviceSpec] = {
    # GeForce: FP16/BF16 tensor, dense, FP32 accumulate (the PyTorch path; FP16-accumulate headline in brackets)
    "rtx3090": DeviceSpec("GeForce RTX 3090", 936.2 * GB, 71 * TF, 24, "pcie4_x16",
                          source=f"{_GA102} App. A: 936.2 GB/s, 71 (142) TFLOP/s, 24 GB, PCIe 4.0 x16"),
    "rtx4090": DeviceSpec("GeForce RTX 4090", 1008 * GB, 165.2 * TF, 24, "pcie4_x16",
                          source=f"{_ADA}: 1008 GB/s, 165.2 (330.3) TFLOP/s, 24 GB"),
    "rtx5090": DeviceSpec("GeForce RTX 5090", 1792 * GB, 209.5 * TF, 32, "pcie5_x16",
                          source="nvidia.com RTX 5090 page: 1792 GB/s, 32 GB, PCIe 5.0; 419 TFLOP/s FP16-accumulate "
                                 "dense, FP32-accumulate rate unpublished: 209.5 = half, by analogy with Ada "
                                 "(estimate)"),
    "rtx4070": DeviceSpec("GeForce RTX 4070", 504 * GB, 58.3 * TF, 12, "pcie4_x16",
                          source=f"{_ADA}: 504 GB/s, 58.3 (116.6)"),
    "rtx3060": DeviceSpec("GeForce RTX 3060 12GB", 360 * GB, 25.5 * TF, 12, "pcie4_x16",
                          source=f"{_GA102}: 360 GB/s, 25.5 (51)"),
    "rtx4060_laptop": DeviceSpec("GeForce RTX 4060 Laptop GPU", 256 * GB, 21.5 * TF, 8, "pcie4_x8",
                                 source="nvidia.com 40-series laptops: 256 GB/s, 8 GB, PCIe 4.0 x8; 21.5 (43) TFLOP/s"),
    "rtx2080": DeviceSpec("GeForce RTX 2080", 448 * GB, 40.3 * TF, 8, "pcie3_x16",
                          source="NVIDIA Turing whitepaper: 448 GB/s, 8 GB; FP16 tensor with FP32 accumulate 40.3 "
                                 "(80.5 FP16-accumulate) TFLOP/s (estimate from the whitepaper's ratios)"),
    "rtx4080": DeviceSpec("GeForce RTX 4080", 716.8 * GB, 97.5 * TF, 16, "pcie4_x16",
                          source=f"{_ADA}: 716.8 GB/s, 16 GB; 97.5 (195) TFLOP/s"),
    "gtx1080ti": DeviceSpec("GeForce GTX 1080 Ti", 484 * GB, 11.3 * TF, 11, "pcie3_x16",
                            source="nvidia.com 10-series: 484 GB/s, 11 GB, PCIe 3.0; no tensor cores: fp16 GEMM at the "
                                   "11.3 TFLOP/s FP32 rate (cuBLAS FP32 compute)"),
    # data centre: dense BF16/FP16 tensor (never the 2:4-sparsity headline)
    "a100_40gb": DeviceSpec("A100 40GB (SXM4)", 1555 * GB, 312 * TF, 40, "pcie4_x16",
                            source=f"{_A100}: 1555 GB/s, 312 dense"),
    "a100_80gb": DeviceSpec("A100 80GB (SXM4)", 2039 * GB, 312 * TF, 80, "pcie4_x16",
                            source=f"{_A100}: 2039 GB/s, 312 dense"),
    "a100_80gb_pcie": DeviceSpec("A100 80GB PCIe", 1935 * GB, 312 * TF, 80, "pcie4_x16", source=f"{_A100}: 1935 GB/s"),
    "h100_sxm": DeviceSpec("H100 SXM5 80GB", 3350 * GB, 989 * TF, 80, "pcie5_x16",
                           source=f"{_H100}: 3.35 TB/s, 989 dense BF16 (1,979 is with sparsity)"),
    "h200": DeviceSpec("H200 SXM 141GB", 4800 * GB, 989 * TF, 141, "pcie5_x16",
                       source="NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 141 GB, 989 dense BF16 (as H100 SXM); measured "
                              "here on a lent one: device copy ~4.3 TB/s, 8192^3 bf16 GEMM 770-800 TFLOP/s"),
    "h100_pcie": DeviceSpec("H100 PCIe 80GB", 2000 * GB, 756 * TF, 80, "pcie5_x16",
                            source=f"{_H100}: 2.0 TB/s, 756 dense"),
    "l4": DeviceSpec("NVIDIA L4", 300 * GB, 121 * TF, 24, "pcie4_x16",
                     source="nvidia.com/en-us/data-center/l4: 300 GB/s, 121"),
    "t4": DeviceSpec("Tesla T4", 320 * GB, 65 * TF, 16, "pcie3_x16",
                     source="nvidia.com T4 datasheet: 320 GB/s, 65 TFLOP/s FP16 mixed, 16 GB, PCIe 3.0 x16"),
    # unified memory: the experts are in the same DRAM the accelerator reads; an offloaded tier is an SSD
    "jetson_agx_orin": DeviceSpec("Jetson AGX Orin 64GB", 204.8 * GB, 42.5 * TF, 64, "unified", bw_efficiency=0.7,
                                  compute_efficiency=0.5, unified=True,
                                  source="nvidia.com Jetson Orin: 204.8 GB/s LPDDR5 shared with the CPU, 42.5 TFLOP/s "
                                         "FP16 dense (MAXN); 0.7 / 0.5 efficiencies: OUR estimates"),
    "apple_m2_max": DeviceSpec("Apple M2 Max (38-core GPU)", 400 * GB, 13.6 * TF, 96, "unified", unified=True,
                               source="apple.com newsroom (M2 Max): 400 GB/s unified memory, up to 96 GB; 13.6 TFLOP/s "
                                      "FP32 GPU, fp16 taken at the same rate (Apple publishes no fp16 figure)"),
    "apple_m4_max": DeviceSpec("Apple M4 Max (40-core GPU)", 546 * GB, 17 * TF, 128, "unified", unified=True,
                               source="apple.com newsroom (M4 Max): 546 GB/s, up to 128 GB; GPU rate unpublished: ~17 "
                                      "TFLOP/s (M2 Max scaled by cores and clock; estimate)"),
}


_AMPERE_WS = "nvidia.com RTX A-series data sheet (dense = half the sparsity headline)"
_BLACKWELL = "nvidia.com RTX 50-series / RTX PRO Blackwell pages (FP32-accumulate rate: half the FP16-accumulate " \
             "dense figure, by analogy with Ada; estimate)"
DEVICES.update({
    "rtx3090ti": DeviceSpec("GeForce RTX 3090 Ti", 1008 * GB, 80 * TF, 24, "pcie4_x16",
                            source=f"{_GA102} and nvidia.com: 1008 GB/s, 24 GB; 80 (160) TFLOP/s"),
    "rtx3080": DeviceSpec("GeForce RTX 3080 10GB", 760 * GB, 59.5 * TF, 10, "pcie4_x16", source=f"{_GA102}: 760 GB/s"),
    "rtx3070": DeviceSpec("GeForce RTX 3070", 448 * GB, 40.6 * TF, 8, "pcie4_x16", source=f"{_GA102}: 448 GB/s"),
    "rtx3080_laptop_16gb": DeviceSpec("GeForce RTX 3080 Laptop 16GB", 448 * GB, 38 * TF, 16, "pcie4_x16",
                                      source="nvidia.com 30-series laptops: 256-bit GDDR6 14 Gbps = 448 GB/s; ~38 "
                                             "TFLOP/s (GA104, 48 SMs at ~1.5 GHz; estimate)"),
    "rtx2080ti": DeviceSpec("GeForce RTX 2080 Ti", 616 * GB, 53.8 * TF, 11, "pcie3_x16",
                            source="NVIDIA Turing whitepaper: 616 GB/s, 11 GB; 53.8 (107.6) TFLOP/s"),
    "rtx4060ti_16gb": DeviceSpec("GeForce RTX 4060 Ti 16GB", 288 * GB, 22.1 * TF, 16, "pcie4_x8",
                                 source=f"{_ADA}: 288 GB/s, PCIe 4.0 x8; 22.1 (44.1)"),
    "rtx4090d": DeviceSpec("GeForce RTX 4090 D", 1008 * GB, 147 * TF, 24, "pcie4_x16",
                           source="nvidia.cn RTX 4090 D: 1008 GB/s, 24 GB, 114 SMs: the 4090's rate x 114/128"),
    "rtx5080": DeviceSpec("GeForce RTX 5080", 960 * GB, 112.6 * TF, 16, "pcie5_x16", source=f"{_BLACKWELL}: 960 GB/s"),
    "rtx5070ti": DeviceSpec("GeForce RTX 5070 Ti", 896 * GB, 87.9 * TF, 16, "pcie5_x16",
                            source=f"{_BLACKWELL}: 896 GB/s"),
    "rtx5060ti_16gb": DeviceSpec("GeForce RTX 5060 Ti 16GB", 448 * GB, 47.4 * TF, 16, "pcie5_x8",
                                 source=f"{_BLACKWELL}: 448 GB/s, PCIe 5.0 x8"),
    "rtx_pro_6000": DeviceSpec("RTX PRO 6000 Blackwell", 1792 * GB, 251.9 * TF, 96, "pcie5_x16",
                               source=f"{_BLACKWELL}: 1792 GB/s, 96 GB GDDR7"),
    "rtx2000_ada": DeviceSpec("RTX 2000 Ada 16GB", 224 * GB, 48 * TF, 16, "pcie4_x8",
                              source="nvidia.com RTX 2000 Ada data sheet: 224 GB/s, 16 GB, PCIe 4.0 x8; ~48 TFLOP/s "
                                     "FP16 dense (estimate from its 12 TFLOP/s FP32)"),
    "quadro_rtx6000": DeviceSpec("Quadro RTX 6000", 672 * GB, 130.5 * TF, 24, "pcie3_x16",
                                 source="nvidia.com Quadro RTX 6000 data sheet: 672 GB/s, 24 GB, 130.5 tensor TFLOP/s"),
    "rtx_a4000": DeviceSpec("RTX A4000", 448 * GB, 76.7 * TF, 16, "pcie4_x16", source=f"{_AMPERE_WS}: 448 GB/s"),
    "rtx_a5000": DeviceSpec("RTX A5000", 768 * GB, 111.1 * TF, 24, "pcie4_x16", source=f"{_AMPERE_WS}: 768 GB/s"),
    "rtx_a6000": DeviceSpec("RTX A6000", 768 * GB, 154.8 * TF, 48, "pcie4_x16", source=f"{_AMPERE_WS}: 768 GB/s"),
    "l40s": DeviceSpec("NVIDIA L40S", 864 * GB, 362 * TF, 48, "pcie4_x16",
                       source="nvidia.com L40S: 864 GB/s, 362 dense"),
    "v100": DeviceSpec("Tesla V100 SXM2 32GB", 900 * GB, 125 * TF, 32, "pcie3_x16",
                       source="nvidia.com V100: 900 GB/s, 125"),
    "rx7900xtx": DeviceSpec("Radeon RX 7900 XTX", 960 * GB, 122.8 * TF, 24, "pcie4_x16",
                            source="amd.com RX 7900 XTX: 960 GB/s, 24 GB; 122.8 TFLOP/s FP16 (WMMA)"),
    "dgx_spark": DeviceSpec("DGX Spark (GB10)", 273 * GB, 125 * TF, 128, "unified", unified=True,
                            source="nvidia.com DGX Spark: 128 GB LPDDR5x unified, 273 GB/s; 1 PFLOP FP4 sparse -> "
                                   "~125 TFLOP/s FP16 dense (estimate)"),
    "apple_m3_ultra": DeviceSpec("Apple M3 Ultra (80-core GPU)", 819 * GB, 28 * TF, 512, "unified", unified=True,
                                 source="apple.com newsroom (M3 Ultra): 819 GB/s, up to 512 GB; ~28 TFLOP/s "
                                        "(estimate)"),
})
_SIZE = {"gib": 1.0, "gb": 1e9 / 2**30, "mib": 2**-10, "tib": 2**10}
_RATE = {"gbps": 1e9, "tbps": 1e12, "tflops": 1e12, "gflops": 1e9}


def _spec_number(text: str, units: dict, flag: str, usage: str) -> float:
    import re

    m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]+)", text)
    if m is None or m.group(2) not in units or float(m.group(1)) <= 0:
        raise ValueError(usage)
    return float(m.group(1)) * units[m.group(2)]


def device(name: str, flag: str = "--device") -> DeviceSpec:
    """A device of `DEVICES` by name, or a spec ``mem=20GiB,bw=800GBps,fp16=103TFLOPS[,link=pcie4_x16]
    [,unified=yes]`` (one clear line naming the flag for anything else)."""
    text = str(name).strip().lower()
    if text in DEVICES:
        return DEVICES[text]
    usage = (f"{flag} {name!r}: give a device name ({', '.join(sorted(DEVICES))}) or a spec such as "
             "mem=20GiB,bw=800GBps,fp16=103TFLOPS")
    if "=" not in text:
        raise ValueError(usage)
    kv = dict(part.partition("=")[::2] for part in text.split(","))
    if not {"mem", "bw", "fp16"} <= set(kv) or not set(kv) <= {"mem", "bw", "fp16", "link", "unified"}:
        raise ValueError(usage)
    unified = kv.get("unified", "no") in ("yes", "1", "true")
    from fate_lab.hardware.links import LINK_PROFILES

    if kv.get("link", "pcie4_x16") not in LINK_PROFILES:
        raise ValueError(f"{flag} {name!r}: link={kv['link']!r}; choose one of {', '.join(sorted(LINK_PROFILES))}")
    return DeviceSpec(f"device {name}", _spec_number(kv["bw"], {k: v for k, v in _RATE.items() if "bps" in k}, flag,
                                                     usage),
                      _spec_number(kv["fp16"], {k: v for k, v in _RATE.items() if "flops" in k}, flag, usage),
                      _spec_number(kv["mem"], _SIZE, flag, usage),
                      "unified" if unified else kv.get("link", "pcie4_x16"),
                      unified=unified, source="--device spec")
