"""Host-to-device link profiles, real and scaled, for the transfer engine.

What this file is: named `LinkProfile`s (effective bandwidth + per-transfer latency) for the
links the Fate paper and edge deployments use (PCIe 1.0/3.0/4.0 x16, an NVMe SSD), and a
*scaled* mode: `RealSetup` describes a real machine + model (one expert's bytes, one
decoder layer's decode compute time, the link), and `scaled_profile` builds a profile for the
tiny model here so that (one expert's transfer time) / (one layer's compute time) equals the
real setup's ratio. That way a tiny model on a CPU meets the same bottleneck as the paper.

What it is not: it moves no bytes and measures nothing itself; `transfer.py` holds the link
for the profile's time and `runtime.py` calibrates the tiny model's layer time.
All numbers below are assumptions with their derivation written next to them.
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class LinkProfile:
    """A host->device link: effective bandwidth and a fixed latency per transfer."""

    name: str
    bandwidth: float  # bytes/s, *effective* (what a pinned H2D copy reaches), not the spec sheet
    latency: float  # s added per transfer (driver/DMA setup, or SSD access time)
    source: str = ""  # where the numbers come from
    scaled_from: str | None = None  # name of the RealSetup this profile was scaled to, if any

    def transfer_time(self, nbytes: int) -> float:
        """Seconds the link is busy moving nbytes."""
        return self.latency + nbytes / self.bandwidth

    def describe(self) -> str:
        """One line for tables and logs: name, bandwidth, latency, and scaling."""
        text = f"{self.name} ({self.bandwidth / GB:.3g} GB/s, {self.latency * 1e6:.0f} us/transfer)"
        if self.scaled_from:
            text += f", scaled to {self.scaled_from}"
        return text


# Effective bandwidths: a pinned-memory host->device cudaMemcpyAsync reaches ~75-80% of the
# PCIe payload rate (128b/130b coding, TLP overhead); bandwidthTest on an RTX 3090 in a PCIe 3.0
# x16 slot reports ~12-13 GB/s. Spec rates: PCIe 1.0 x16 4 GB/s, 3.0 x16 15.75 GB/s, 4.0 x16 31.5 GB/s.
# Latency: ~10 us per copy launch + DMA setup. NVMe: a PCIe 3.0 x4 consumer SSD reads ~3.5 GB/s
# sequentially (the DESIGN range is 3-7 GB/s); ~100 us access latency.
LINK_PROFILES: dict[str, LinkProfile] = {
    "pcie1_x16": LinkProfile("PCIe 1.0 x16", 3.0 * GB, 10e-6, "4 GB/s spec x ~0.75 efficiency"),
    "pcie3_x16": LinkProfile("PCIe 3.0 x16", 12.0 * GB, 10e-6, "15.75 GB/s spec; ~12 GB/s measured pinned H2D"),
    "pcie4_x16": LinkProfile("PCIe 4.0 x16", 25.0 * GB, 10e-6, "31.5 GB/s spec; ~25 GB/s measured pinned H2D"),
    "nvme": LinkProfile("NVMe SSD (PCIe 3.0 x4)", 3.5 * GB, 100e-6, "consumer NVMe sequential read"),
    # For correctness tests: a link so fast it never dominates, yet still asynchronous.
    "test_fast": LinkProfile("test link (100 GB/s)", 100.0 * GB, 0.0, "tests only"),
}


@dataclass(frozen=True)
class RealSetup:
    """A real machine + model whose transfer/compute ratio a scaled link reproduces."""

    name: str
    expert_bytes: int  # bytes of one routed expert as it travels
    layer_compute_s: float  # one decoder layer's decode-step compute time (batch 1)
    link: str  # key in LINK_PROFILES
    source: str = ""

    def expert_transfer_s(self) -> float:
        """Seconds to move one expert over the real link."""
        return LINK_PROFILES[self.link].transfer_time(self.expert_bytes)

    def ratio(self) -> float:
        """(one expert's transfer time) / (one layer's compute time) on the real setup."""
        return self.expert_transfer_s() / self.layer_compute_s


# Qwen1.5-MoE-A2.7B: hidden 2048, expert intermediate 1408, fp16 -> one expert is
# 3 x 2048 x 1408 x 2 B = 17,301,504 B. One decode layer reads: attention 4 x 2048^2 x 2 B
# = 33.6 MB, 4 routed experts 69.2 MB, shared expert (intermediate 5632) 69.2 MB: ~172 MB at
# ~936 GB/s x 0.7 achievable -> 0.26 ms, plus ~25 kernel launches x ~10 us in eager PyTorch
# -> ~0.5 ms per layer (24 layers -> ~12 ms/token, ~80 tok/s all on GPU). This is our
# estimate, not a number from the paper. Over PCIe 3.0 one expert takes 1.44 ms: ratio ~2.9.
# DeepSeek-MoE-16B on a GTX 1080 Ti (484 GB/s): expert 3 x 2048 x 1408 x 2 B as well, 28 layers;
# a layer reads attention 33.6 MB + 6 routed + 2 shared experts 138 MB = 172 MB -> ~0.5 ms at
# 70% + launches ~0.25 ms -> ~0.75 ms; the paper's low-end link, PCIe 1.0 x16 (3 GB/s): 5.8 ms.
REAL_SETUPS: dict[str, RealSetup] = {
    "qwen15_moe_rtx3090_pcie3": RealSetup(
        "Qwen1.5-MoE-A2.7B fp16 on RTX 3090 over PCIe 3.0 x16", 3 * 2048 * 1408 * 2, 0.5e-3, "pcie3_x16",
        "expert bytes from the model config; layer time estimated (roofline + launch overhead)",
    ),
    "qwen15_moe_rtx3090_pcie4": RealSetup(
        "Qwen1.5-MoE-A2.7B fp16 on RTX 3090 over PCIe 4.0 x16", 3 * 2048 * 1408 * 2, 0.5e-3, "pcie4_x16",
        "as above, with a PCIe 4.0 link",
    ),
    "deepseek_moe_1080ti_pcie1": RealSetup(
        "DeepSeek-MoE-16B fp16 on GTX 1080 Ti over PCIe 1.0 x16", 3 * 2048 * 1408 * 2, 0.75e-3, "pcie1_x16",
        "expert bytes from the model config; layer time estimated (roofline + launch overhead)",
    ),
}


def scaled_profile(setup: str | RealSetup, expert_bytes: int, layer_compute_s: float) -> LinkProfile:
    """A link for a model whose expert has expert_bytes and whose layer takes layer_compute_s,
    giving the same expert-transfer / layer-compute ratio as the named real setup."""
    real = REAL_SETUPS[setup] if isinstance(setup, str) else setup
    if layer_compute_s <= 0 or expert_bytes <= 0:
        raise ValueError(f"need positive expert_bytes and layer_compute_s, got {expert_bytes}, {layer_compute_s}")
    base = LINK_PROFILES[real.link]
    target_s = real.ratio() * layer_compute_s  # one tiny expert's transfer time
    latency_share = base.latency / real.expert_transfer_s()  # keep the real latency/bandwidth split
    latency = target_s * latency_share
    bandwidth = expert_bytes / (target_s - latency)
    return LinkProfile(
        name=f"scaled {base.name}", bandwidth=bandwidth, latency=latency,
        source=f"ratio {real.ratio():.2f} of {real.name}; tiny layer {layer_compute_s * 1e3:.3f} ms",
        scaled_from=real.name,
    )


def link_names() -> list[str]:
    """Every name `resolve_link` accepts: real profiles and real setups to scale to."""
    return sorted(LINK_PROFILES) + sorted(REAL_SETUPS)


def resolve_link(name: str, expert_bytes: int | None = None, layer_compute_s: float | None = None) -> LinkProfile:
    """The profile named `name`; a REAL_SETUPS name gives the scaled profile (needs the tiny sizes)."""
    if name in LINK_PROFILES:
        return LINK_PROFILES[name]
    if name in REAL_SETUPS:
        if expert_bytes is None or layer_compute_s is None:
            raise ValueError(f"scaled link {name!r} needs expert_bytes and a calibrated layer_compute_s")
        return scaled_profile(name, expert_bytes, layer_compute_s)
    raise ValueError(f"unknown link {name!r}; choose one of {link_names()}")
