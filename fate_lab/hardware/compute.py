"""Device compute profiles: the seconds each piece of one forward takes, for the timed simulator.

What this file is: `ComputeProfile` (per-layer dense compute, per-expert compute, the experts call's
bookkeeping, the host-side prediction, and what a CPU emulation of a link costs) and `COMPUTE_PROFILES`,
named profiles of real models on real devices, every number derived in a comment. These are OUR
estimates (roofline + launch overhead), not measurements and not the paper's numbers.
What it is not: a calibration of this machine (`fate_lab/fit/calibrate.py` measures one from the runtime).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields


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
    landed_s: float = 0.0  # extra dense time per landed transfer (CPU emulation: the link's copies
    # evict the dense weights from the shared caches; 0 on a GPU)
    link_extra_s: float = 0.0  # an emulated transfer's overshoot beyond latency + bytes/bandwidth (sleep
    # granularity of the worker thread); 0 for a real link
    wake_s: float = 0.0  # from a transfer landing to the waiting compute thread running again
    source: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("name", "source"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"ComputeProfile {self.name!r}: {f.name}={v!r} s; give a finite number of "
                                 "seconds >= 0")
        if self.dense_s + self.expert_s <= 0:
            raise ValueError(f"ComputeProfile {self.name!r}: dense_s and expert_s are both 0, so a forward takes no "
                             "time and tokens/s is undefined; give at least one of them > 0")

    def dense(self, T: int) -> float:
        """One layer's dense compute for T tokens."""
        return self.dense_s + self.dense_per_token_s * (T - 1)

    def expert(self, n: int) -> float:
        """One expert's compute on n tokens."""
        return self.expert_s + self.expert_per_token_s * (n - 1)

    def predict(self, T: int) -> float:
        """One host-side prediction for T tokens."""
        return self.predict_s + self.predict_per_token_s * (T - 1)

    def decode_layer_s(self, top_k: int) -> float:
        """One MoE decoder layer of a decode token with top_k experts computed: the clock a scaled link keeps."""
        return self.dense_s + top_k * self.expert_s + self.call_s


# Qwen1.5-MoE-A2.7B fp16, batch 1, eager PyTorch. A decode layer reads attention 33.6 MB + shared
# expert 69.2 MB at ~936 GB/s x 0.7 (RTX 3090) ~ 0.16 ms plus ~20 launches x 10 us ~ 0.2 ms -> 0.36 ms
# dense; one routed expert (17.3 MB) 0.026 ms + 3 launches -> ~0.035 ms; 4 of them + dense ~ 0.5 ms
# (24 layers -> ~12 ms/token, ~80 tok/s all on the GPU). Host prediction: a [1, 2048] x [2048, 60]
# GEMV + sort on a desktop CPU ~ 20 us (measured order of magnitude here).
# RTX 4090 (1008 GB/s, faster launches) ~ 0.8x; a laptop RTX 4060 (256 GB/s) ~ 2.5x the dense time.
# DeepSeek-MoE-16B fp16 on a GTX 1080 Ti (484 GB/s): attention 33.6 MB + 2 shared experts 34.6 MB at
# 484 x 0.7 GB/s ~ 0.2 ms + ~15 launches x 10 us -> 0.35 ms dense; one routed expert (17.3 MB, the same
# width as Qwen1.5-MoE's) 0.051 ms + 3 launches -> 0.08 ms; 6 of them + dense ~ 0.84 ms a layer.
COMPUTE_PROFILES: dict[str, ComputeProfile] = {
    "qwen15_moe_rtx3090": ComputeProfile("Qwen1.5-MoE-A2.7B fp16 on RTX 3090", 0.36e-3, 0.002e-3, 0.035e-3,
                                         0.0005e-3, 0.01e-3, 0.02e-3, 0.0,
                                         source="roofline + launch overhead estimate (see module comment)"),
    "qwen15_moe_rtx4090": ComputeProfile("Qwen1.5-MoE-A2.7B fp16 on RTX 4090", 0.29e-3, 0.0015e-3, 0.028e-3,
                                         0.0004e-3, 0.01e-3, 0.02e-3, 0.0, source="RTX 3090 estimate x 0.8"),
    "qwen15_moe_laptop4060": ComputeProfile("Qwen1.5-MoE-A2.7B fp16 on a laptop RTX 4060", 0.9e-3, 0.005e-3,
                                            0.09e-3, 0.001e-3, 0.01e-3, 0.03e-3, 0.0,
                                            source="RTX 3090 estimate x 2.5 (256 vs 936 GB/s)"),
    "qwen15_moe_orin": ComputeProfile("Qwen1.5-MoE-A2.7B fp16 on a Jetson AGX Orin (unified memory)", 1.8e-3,
                                      0.01e-3, 0.17e-3, 0.002e-3, 0.02e-3, 0.06e-3, 0.0,
                                      source="204.8 GB/s LPDDR5 at ~0.6 efficiency; ~5x the RTX 3090 estimate"),
    "deepseek_moe_1080ti": ComputeProfile("DeepSeek-MoE-16B fp16 on GTX 1080 Ti", 0.35e-3, 0.003e-3, 0.08e-3,
                                          0.001e-3, 0.01e-3, 0.02e-3, 0.0,
                                          source="roofline + launch overhead estimate (see module comment)"),
}


def compute_profile(name: str) -> ComputeProfile:
    """The profile named `name` (clear error for an unknown one)."""
    if name not in COMPUTE_PROFILES:
        raise ValueError(f"unknown compute profile {name!r}; choose one of {sorted(COMPUTE_PROFILES)}")
    return COMPUTE_PROFILES[name]
