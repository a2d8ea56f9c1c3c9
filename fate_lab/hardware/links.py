"""Host-to-device links: named profiles of effective bandwidth and per-transfer latency.

What this file is: `LinkProfile` and `LINK_PROFILES`, the links the Fate paper and edge deployments use
(PCIe 1.0/3.0/4.0 x16, an NVMe SSD), each number with its source next to it.
What it is not: it moves no bytes (`offloading/transfer.py` holds an emulated link for a profile's time)
and it scales nothing (a link scaled to a real setup's clock is `setups.py`'s one rule).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class LinkProfile:
    """A host->device link: effective bandwidth and a fixed latency per transfer."""

    name: str
    bandwidth: float  # bytes/s, *effective* (what a pinned H2D copy reaches), not the spec sheet
    latency: float  # s added per transfer (driver/DMA setup, or SSD access time)
    source: str = ""  # where the numbers come from
    scaled_from: str | None = None  # name of the setup this profile was scaled to, if any
    queue_depth: int = 1  # transfers in flight at once: 1 for a copy engine, an SSD's read queue for a disk


    def __post_init__(self) -> None:
        if not (isinstance(self.bandwidth, (int, float)) and math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"LinkProfile {self.name!r}: bandwidth={self.bandwidth!r} bytes/s; "
                             "give a finite number > 0")
        if not (isinstance(self.latency, (int, float)) and math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"LinkProfile {self.name!r}: latency={self.latency!r} s; give a finite number >= 0")
        if not (isinstance(self.queue_depth, int) and self.queue_depth >= 1):
            raise ValueError(f"LinkProfile {self.name!r}: queue_depth={self.queue_depth!r}; give an int >= 1")

    def transfer_time(self, nbytes: int) -> float:
        """Seconds the link is busy moving nbytes."""
        return self.latency + nbytes / self.bandwidth

    def stream_bandwidth(self, read_bytes: int) -> float:
        """Bytes/s of back-to-back transfers of read_bytes each with queue_depth in flight.

        Each transfer holds one queue entry for latency + read_bytes / bandwidth; the latencies of the
        entries in flight overlap, the bandwidth is shared. So small reads are latency-bound
        (queue_depth x read_bytes / transfer_time) and large or deep-queued ones bandwidth-bound.
        """
        if not (isinstance(read_bytes, int) and read_bytes > 0):
            raise ValueError(f"read_bytes={read_bytes!r}; give an int > 0 (bytes per transfer)")
        return min(self.bandwidth, self.queue_depth * read_bytes / self.transfer_time(read_bytes))

    def describe(self) -> str:
        """One line for tables and logs: name, bandwidth, latency, and scaling."""
        text = f"{self.name} ({self.bandwidth / GB:.3g} GB/s, {self.latency * 1e6:.0f} us/transfer)"
        if self.scaled_from:
            text += f", scaled to {self.scaled_from}"
        return text


# Effective bandwidths: a pinned-memory host->device cudaMemcpyAsync reaches ~75-85% of the
# PCIe payload rate (128b/130b coding, TLP overhead): bandwidthTest on an RTX 3090 in a PCIe 3.0
# x16 slot reports ~12-13 GB/s; nvbandwidth host_to_device_memcpy_ce on RTX 4090s (Gen4 x16) 23.9-26.4
# GB/s (NVIDIA/nvbandwidth issue 15), 0.76-0.84 of the line rate; a cloud T4 (Gen3 x16) 9.7 GB/s.
# Spec rates: PCIe 1.0 x16 4 GB/s, 3.0 x16 15.75, 4.0 x16 31.5, 5.0 x16 63.0 GB/s (x8: half).
# Gen5 has no published copy-engine measurement: 0.8 of the line rate by analogy (estimate).
# Latency: ~10 us per copy launch + DMA setup. NVMe: a PCIe 3.0 x4 consumer SSD reads ~3.5 GB/s
# sequentially (3-7 GB/s across generations); ~100 us access latency. A 980 PRO (Gen4) is rated 7 GB/s
# but HOBBIT measured ~3 GB/s of practical expert reads: rated x 0.45 for Gen4/Gen5 (estimate).
LINK_PROFILES: dict[str, LinkProfile] = {
    "pcie1_x16": LinkProfile("PCIe 1.0 x16", 3.0 * GB, 10e-6, "4 GB/s spec x ~0.75 efficiency"),
    "pcie3_x16": LinkProfile("PCIe 3.0 x16", 12.0 * GB, 10e-6, "15.75 GB/s spec; ~12 GB/s measured pinned H2D"),
    "pcie4_x16": LinkProfile("PCIe 4.0 x16", 25.0 * GB, 10e-6, "31.5 GB/s spec; ~25 GB/s measured pinned H2D"),
    "pcie3_x8": LinkProfile("PCIe 3.0 x8", 6.0 * GB, 10e-6, "7.88 GB/s spec; half of 3.0 x16's measured 12"),
    "pcie4_x8": LinkProfile("PCIe 4.0 x8", 12.6 * GB, 10e-6, "15.75 GB/s spec x 0.8 (laptop GPUs, x8 slots)"),
    "pcie5_x16": LinkProfile("PCIe 5.0 x16", 50.4 * GB, 10e-6, "63.0 GB/s spec x 0.8 (estimate, no measurement)"),
    "pcie5_x8": LinkProfile("PCIe 5.0 x8", 25.2 * GB, 10e-6, "31.5 GB/s spec x 0.8 (estimate)"),
    "nvme": LinkProfile("NVMe SSD (PCIe 3.0 x4)", 3.5 * GB, 100e-6, "consumer NVMe sequential read"),
    "nvme_gen4": LinkProfile("NVMe SSD (PCIe 4.0 x4)", 3.15 * GB, 100e-6,
                             "7 GB/s rated x 0.45 (HOBBIT's practical ~3)"),
    "nvme_gen5": LinkProfile("NVMe SSD (PCIe 5.0 x4)", 6.3 * GB, 100e-6, "14 GB/s rated x 0.45 (estimate)"),
    # Cloud VMs reach less of the line rate (virtualised DMA): a Colab T4 measured 9.7 GB/s pinned H2D
    # (bandwidthTest), 0.62 of PCIe 3.0 x16, which mixtral-offloading's naive T4 row implies too; Gen4 likewise
    "pcie3_x16_cloud": LinkProfile("PCIe 3.0 x16 (cloud VM)", 9.7 * GB, 10e-6, "bandwidthTest on a cloud T4"),
    "pcie4_x16_cloud": LinkProfile("PCIe 4.0 x16 (cloud VM)", 19.5 * GB, 10e-6, "31.5 GB/s x 0.62 (as the cloud T4)"),
    # This machine's disk as a link (link="disk": the runtime really reads each expert with O_DIRECT; this profile
    # only sizes its reader queue and prefetch budget): `python -m fate_lab calibrate-disk` on 2026-12-04, random
    # 64 KiB-4 MiB reads of data/tiny_moe's file: ~2.2 GB/s for 1 MiB+ reads, ~0.12 ms fixed per read, 2 in flight
    "disk": LinkProfile("this machine's disk (O_DIRECT)", 2.2 * GB, 120e-6, "calibrate-disk on this machine",
                        queue_depth=2),
    # For correctness tests: a link so fast it never dominates, yet still asynchronous.
    "test_fast": LinkProfile("test link (100 GB/s)", 100.0 * GB, 0.0, "tests only"),
}


def link_profile(name: str) -> LinkProfile:
    """The profile named `name` (clear error for an unknown one)."""
    if name not in LINK_PROFILES:
        raise ValueError(f"unknown link {name!r}; choose one of {sorted(LINK_PROFILES)}")
    return LINK_PROFILES[name]
