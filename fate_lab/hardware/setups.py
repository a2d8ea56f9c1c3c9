"""Named real setups (a real model on a real machine) and the one rule that scales them to another clock.

What this file is: `Setup` and `SETUPS`, the one table of named setups (compute profile, link, host CPU,
and the real model whose experts travel), `Hardware` (what the timed simulator runs on: a compute
profile, a link, and the expert a host call is charged for), and THE scaling rule, `Setup.on_clock`:

    a model whose expert has `expert_bytes`, running on a clock where one decode layer takes `layer_s`,
    sees the setup's link and host stretched by one factor  clock = layer_s / setup layer time:
    one of its experts takes  clock x (the real expert's transfer time)  to move, and a host call
    clock x (the real expert's host time).

With `layer_s=None` the clock is the setup's own (factor 1): a simulation on the setup's compute profile
with a small model's routing. Either way the ratio (one expert's transfer) / (one layer's compute) is the
real setup's, so a tiny model on a CPU meets the bottleneck the real machine meets.
What it is not: a measurement; every number comes from `links.py`, `hosts.py`, `profiles.py`, `models.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.hosts import HostProfile, HostTime, host_profile
from fate_lab.hardware.links import LINK_PROFILES, LinkProfile, link_profile
from fate_lab.hardware.models import expert_bytes as published_expert_bytes
from fate_lab.hardware.models import published_config
from fate_lab.hardware.profiles import COMPUTE_PROFILES, compute_profile


@dataclass(frozen=True)
class HostRef:
    """The expert a host call is charged for: its bytes, FLOPs per token, and the clock factor."""

    expert_bytes: int
    flops_per_token: float
    scale: float = 1.0


@dataclass(frozen=True)
class Hardware:
    """What a driver runs on: a compute profile (None: the runtime measures its own), a link (None: instant)
    and the expert a host call is charged for (None: the model's own, on its own clock).

    A *scaled* hardware (`Hardware.scaled`) names a setup and a clock instead of a concrete link: the link
    and the host reference follow from the expert size of the model that runs (`for_model`, the one rule
    of `Setup.on_clock`), which only the driver knows.
    """

    compute: ComputeProfile | None
    link: LinkProfile | None
    host_ref: HostRef | None = None
    scaled_from: "Setup | None" = None  # a setup whose link/host the model's experts see ...
    layer_s: float | None = None  # ... on a clock where one decode layer takes layer_s (None: the setup's own)
    host: HostProfile | None = None  # a host CPU given by its spec (plan --host ddr5-4800x12,...): charged instead
    # of the config's named profile

    def for_model(self, expert_bytes: int) -> "Hardware":
        """The concrete hardware a model whose expert has expert_bytes runs on (itself unless scaled)."""
        if self.scaled_from is None:
            return self
        hw = self.scaled_from.on_clock(expert_bytes, self.layer_s)
        return Hardware(self.compute if self.compute is not None else hw.compute, hw.link, hw.host_ref)

    def host_time(self, profile: str, expert_bytes: int, flops_per_token: float) -> HostTime:
        """Seconds one expert (the model's own: expert_bytes, flops_per_token) takes on the host CPU `profile`."""
        ref = self.host_ref or HostRef(expert_bytes, flops_per_token, 1.0)
        return HostTime(self.host or host_profile(profile), ref.expert_bytes, ref.flops_per_token, ref.scale)

    def transfer_s(self, nbytes: int) -> float:
        """Seconds the link takes for nbytes (0 on the instant link)."""
        if self.scaled_from is not None:
            raise ValueError("a scaled Hardware has no concrete link yet: call for_model(expert_bytes) first")
        return 0.0 if self.link is None else self.link.transfer_time(nbytes)

    def describe(self) -> str:
        """One line: the link (or the setup it is scaled to) and the compute profile."""
        link = "instant" if self.link is None and self.scaled_from is None else \
            self.link.describe() if self.link is not None else f"{self.scaled_from.name}, scaled"
        return link + ("" if self.compute is None else f"; compute {self.compute.name}")

    @classmethod
    def setup(cls, name: str) -> "Hardware":
        """A named setup as it is: its compute profile, its link, host calls charged for its own model."""
        return setup(name).hardware()

    @classmethod
    def scaled(cls, name: str, layer_s: float | None = None, compute: ComputeProfile | None = None) -> "Hardware":
        """A named setup's link and host for whatever model runs (`for_model`): on the setup's own clock with its
        compute profile (layer_s None), or on a clock where one decode layer takes layer_s with `compute`."""
        s = setup(name)
        if layer_s is not None and not (isinstance(layer_s, (int, float)) and 0 < layer_s < float("inf")):
            raise ValueError(f"layer_s={layer_s!r}: give the seconds of one decode layer, > 0 and finite")
        return cls(compute_profile(s.compute) if layer_s is None and compute is None else compute, None,
                   scaled_from=s, layer_s=layer_s)


@dataclass(frozen=True)
class Setup:
    """A real model on a real machine: the compute profile, the link its experts cross, the host CPU."""

    name: str
    model: str  # a published model (`models.PAPER_MODELS` / `OTHER_MODELS`): whose experts travel
    compute: str  # `compute.COMPUTE_PROFILES` key
    link: str  # `links.LINK_PROFILES` key
    host: str = "desktop_ddr4"  # `hosts.HOST_PROFILES` key
    source: str = ""

    def expert_bytes(self) -> int:
        """Bytes of one of the real model's routed experts (fp16)."""
        return published_expert_bytes(self.model)

    def top_k(self) -> int:
        """Experts per token of the real model."""
        return int(published_config(self.model)["num_experts_per_tok"])

    def layer_s(self) -> float:
        """One decode layer of the real model on the real device (the profile's estimate)."""
        return compute_profile(self.compute).decode_layer_s(self.top_k())

    def ratio(self) -> float:
        """(one real expert's transfer time) / (one real decode layer's compute time)."""
        return link_profile(self.link).transfer_time(self.expert_bytes()) / self.layer_s()

    def hardware(self) -> Hardware:
        """The setup itself: its compute profile and link, host calls charged for its model's experts."""
        b = self.expert_bytes()  # fp16: 2 bytes and 2 FLOPs per weight and token, so FLOPs/token == bytes
        return Hardware(compute_profile(self.compute), link_profile(self.link), HostRef(b, float(b), 1.0))

    def on_clock(self, expert_bytes: int, layer_s: float | None = None) -> Hardware:
        """THE scaling rule (module docstring): the setup's link and host for a model whose expert has
        expert_bytes, on a clock where one decode layer takes layer_s (None: the setup's own clock, whose
        compute profile then comes along; a given layer_s leaves compute to the caller's measurement)."""
        if isinstance(expert_bytes, bool) or not isinstance(expert_bytes, int) or expert_bytes <= 0:
            raise ValueError(f"expert_bytes={expert_bytes!r}: give the bytes of one expert as an int > 0")
        if layer_s is not None and not (isinstance(layer_s, (int, float)) and 0 < layer_s < float("inf")):
            raise ValueError(f"layer_s={layer_s!r}: give the seconds of one decode layer, > 0 and finite")
        clock = 1.0 if layer_s is None else layer_s / self.layer_s()
        real, b = link_profile(self.link), self.expert_bytes()
        link = LinkProfile(f"scaled {real.name}", real.bandwidth * expert_bytes / b / clock,
                           real.latency * clock, f"ratio {self.ratio():.2f} of {self.name}"
                           + ("" if layer_s is None else f"; layer {layer_s * 1e3:.3f} ms here"), scaled_from=self.name)
        compute = compute_profile(self.compute) if layer_s is None else None
        return Hardware(compute, link, HostRef(b, float(b), clock))


SETUPS: dict[str, Setup] = {s.name: s for s in (
    Setup("qwen15_moe_rtx3090_pcie3", "Qwen1.5-MoE-A2.7B", "qwen15_moe_rtx3090", "pcie3_x16",
          source="the paper's first setup (RTX 3090, PCIe 3.0 x16)"),
    Setup("qwen15_moe_rtx3090_pcie4", "Qwen1.5-MoE-A2.7B", "qwen15_moe_rtx3090", "pcie4_x16",
          source="as above, with a PCIe 4.0 link"),
    Setup("qwen15_moe_rtx4090_pcie4", "Qwen1.5-MoE-A2.7B", "qwen15_moe_rtx4090", "pcie4_x16"),
    Setup("qwen15_moe_laptop4060_pcie4x8", "Qwen1.5-MoE-A2.7B", "qwen15_moe_laptop4060", "pcie3_x16",
          "laptop_ddr5", "a laptop RTX 4060 has PCIe 4.0 x8, about the bandwidth of 3.0 x16"),
    Setup("qwen15_moe_orin_nvme", "Qwen1.5-MoE-A2.7B", "qwen15_moe_orin", "nvme", "orin_cpu",
          "Jetson AGX Orin: unified memory, experts read from an NVMe SSD"),
    Setup("deepseek_moe_1080ti_pcie1", "DeepSeek-MoE-16B", "deepseek_moe_1080ti", "pcie1_x16",
          source="the paper's low-end setup (GTX 1080 Ti, its slowest link)"),
)}


def setup(name: str) -> Setup:
    """The setup named `name` (clear error for an unknown one)."""
    if name not in SETUPS:
        raise ValueError(f"unknown setup {name!r}; choose one of {sorted(SETUPS)}")
    return SETUPS[name]


def link_names() -> list[str]:
    """Every link name a run accepts: real profiles, and setups to scale to (`OffloadConfig.link`)."""
    return sorted(LINK_PROFILES) + sorted(SETUPS)


def is_scaled(link: str) -> bool:
    """True when `link` names a setup (its profile needs this machine's layer time)."""
    return link in SETUPS


def run_hardware(link: str, layer_s: float | None = None, compute: ComputeProfile | None = None) -> Hardware:
    """The hardware a run over `link` uses: "instant", a real profile, or a setup scaled to this run's clock
    (needs layer_s, this machine's calibrated decode-layer time), with `compute` (None: the runtime measures)."""
    if link == "instant":
        return Hardware(compute, None)
    if link in LINK_PROFILES:
        return Hardware(compute, LINK_PROFILES[link])
    if link in SETUPS:
        if layer_s is None:
            raise ValueError(f"the scaled link {link!r} needs this machine's layer time (layer_s)")
        return Hardware.scaled(link, layer_s, compute)
    raise ValueError(f"unknown link {link!r}; choose 'instant' or one of {link_names()}")


def resolve_link(name: str, expert_bytes: int | None = None, layer_s: float | None = None) -> LinkProfile:
    """The profile named `name`; a setup's name gives its link on this clock (`run_hardware`)."""
    if name in SETUPS and (expert_bytes is None or layer_s is None):
        raise ValueError(f"scaled link {name!r} needs expert_bytes and a calibrated layer_s")
    hw = run_hardware(name, layer_s).for_model(expert_bytes or 1)
    if hw.link is None:
        raise ValueError("the instant link has no profile")
    return hw.link


__all__ = ["COMPUTE_PROFILES", "Hardware", "HostRef", "SETUPS", "Setup", "is_scaled", "link_names", "resolve_link",
           "run_hardware", "setup"]
