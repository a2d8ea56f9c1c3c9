"""Named compute profiles of real models on real devices: derived by the roofline, and hand estimates beside them.

What this file is: `COMPUTE_PROFILES`, each the roofline (`roofline.py`) of a published model's costs
(`models.PUBLISHED_COSTS`) on a catalogued device (`devices.py`) with the prediction on a catalogued host CPU;
and `HAND_PROFILES`, constants estimated by hand for the same pairs (the arithmetic in the comment above
them), for the side-by-side comparison (`compare_profiles`). Both are OUR estimates, not measurements, not the paper's.
What it is not: a calibration of this machine (`fate_lab/fit/calibrate.py`).
"""
from __future__ import annotations

from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.devices import DEVICES
from fate_lab.hardware.hosts import HOST_PROFILES
from fate_lab.hardware.models import PUBLISHED_COSTS
from fate_lab.hardware.roofline import derive_compute

# (model, device, host CPU of the prediction) of every named profile
_PAIRS = {
    "qwen15_moe_rtx3090": ("Qwen1.5-MoE-A2.7B", "rtx3090", "desktop_ddr4"),
    "qwen15_moe_rtx4090": ("Qwen1.5-MoE-A2.7B", "rtx4090", "desktop_ddr4"),
    "qwen15_moe_laptop4060": ("Qwen1.5-MoE-A2.7B", "rtx4060_laptop", "laptop_ddr5"),
    "qwen15_moe_orin": ("Qwen1.5-MoE-A2.7B", "jetson_agx_orin", "orin_cpu"),
    "deepseek_moe_1080ti": ("DeepSeek-MoE-16B", "gtx1080ti", "desktop_ddr4"),
}
COMPUTE_PROFILES: dict[str, ComputeProfile] = {
    name: derive_compute(PUBLISHED_COSTS[model], DEVICES[dev], HOST_PROFILES[host],
                         f"{model} fp16 on {DEVICES[dev].name} (roofline)")
    for name, (model, dev, host) in _PAIRS.items()
}

# Qwen1.5-MoE-A2.7B fp16, batch 1, eager PyTorch. A decode layer reads attention 33.6 MB + shared
# expert 69.2 MB at ~936 GB/s x 0.7 (RTX 3090) ~ 0.16 ms plus ~20 launches x 10 us ~ 0.2 ms -> 0.36 ms
# dense; one routed expert (17.3 MB) 0.026 ms + 3 launches -> ~0.035 ms; 4 of them + dense ~ 0.5 ms
# (24 layers -> ~12 ms/token, ~80 tok/s all on the GPU). Host prediction: a [1, 2048] x [2048, 60]
# GEMV + sort on a desktop CPU ~ 20 us (measured order of magnitude here).
# RTX 4090 (1008 GB/s, faster launches) ~ 0.8x; a laptop RTX 4060 (256 GB/s) ~ 2.5x the dense time.
# DeepSeek-MoE-16B fp16 on a GTX 1080 Ti (484 GB/s): attention 33.6 MB + 2 shared experts 34.6 MB at
# 484 x 0.7 GB/s ~ 0.2 ms + ~15 launches x 10 us -> 0.35 ms dense; one routed expert (17.3 MB, the same
# width as Qwen1.5-MoE's) 0.051 ms + 3 launches -> 0.08 ms; 6 of them + dense ~ 0.84 ms a layer.
HAND_PROFILES: dict[str, ComputeProfile] = {
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
    """The derived profile named `name` (clear error for an unknown one)."""
    if name not in COMPUTE_PROFILES:
        raise ValueError(f"unknown compute profile {name!r}; choose one of {sorted(COMPUTE_PROFILES)}")
    return COMPUTE_PROFILES[name]


def compare_profiles() -> list[dict]:
    """Each named profile, hand estimate beside roofline: decode layer time at the model's top-k, in ms."""
    from fate_lab.hardware.models import published_config

    rows = []
    for name, (model, dev, _) in _PAIRS.items():
        k = int(published_config(model)["num_experts_per_tok"])
        old, new = HAND_PROFILES[name], COMPUTE_PROFILES[name]
        rows.append({"profile": name, "model": model, "device": DEVICES[dev].name,
                     "dense ms (hand)": 1e3 * old.dense_s, "dense ms (roofline)": 1e3 * new.dense_s,
                     "expert ms (hand)": 1e3 * old.expert_s, "expert ms (roofline)": 1e3 * new.expert_s,
                     "decode layer ms (hand)": 1e3 * old.decode_layer_s(k),
                     "decode layer ms (roofline)": 1e3 * new.decode_layer_s(k)})
    return rows
