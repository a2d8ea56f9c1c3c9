"""The host system as its data sheet describes it: memory type, transfer rate, channels, sockets, cores, RAM.

What this file is: `HostSpec` (peak DRAM bandwidth = channels x 8 bytes x MT/s per socket; peak FP32 rate =
cores x GHz x FLOPs a cycle), `HOSTS` (the CPUs of published measurements, each with its source) and
`host_spec(text)`, which takes a name or a description such as ``ddr4-3200x2`` or
``ddr5-4800x12,sockets=2,cores=32,ram=768GiB`` (channels per socket, cores per socket).
What it is not: how much of the peak an engine reaches (`engines.py`), or the simulator's host profiles
(`hosts.py`: effective numbers for the runtime presets' host compute).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

MEMORY_TYPES = ("ddr4", "ddr5", "lpddr4x", "lpddr5", "lpddr5x")
SIMD_FLOPS = {"avx2": 32, "avx512": 64, "zen4": 32, "neon": 16, "sve2": 32}  # FP32 FLOPs a cycle a core
# (two FMA pipes x lanes x 2): AVX2 2x8x2, AVX-512 with two FMA units 2x16x2, Zen 4 runs AVX-512 double-pumped
# (AVX2's rate), Neon 4x4-lane FMA on Cortex-X/Neoverse V cores at 2x4x2, SVE2 on Neoverse V2 4x4x2
_UNITS = {"gib": 2**30, "gb": 1e9, "tib": 2**40, "tb": 1e12, "mib": 2**20}


@dataclass(frozen=True)
class HostSpec:
    """A host CPU and its memory: what the data sheet says."""

    name: str
    memory: str  # one of MEMORY_TYPES
    mts: float  # transfers per second of the memory, in millions (DDR4-3200: 3200)
    channels: int  # 64-bit channels per socket (LPDDR: a 256-bit bus counts 4)
    sockets: int = 1
    cores: int = 8  # per socket
    ghz: float = 3.0  # all-core clock
    simd: str = "avx2"
    ram_gib: float | None = None  # installed RAM; None: not given (assumed to hold what the CPU keeps)
    source: str = ""

    def __post_init__(self) -> None:
        if self.memory not in MEMORY_TYPES:
            raise ValueError(f"host {self.name!r}: memory {self.memory!r}; choose one of {MEMORY_TYPES}")
        for f in ("mts", "ghz"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"host {self.name!r}: {f}={v!r}; give a finite number > 0")
        for f in ("channels", "sockets", "cores"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= 4096:
                raise ValueError(f"host {self.name!r}: {f}={v!r}; give a whole number from 1 to 4096")
        if self.simd not in SIMD_FLOPS:
            raise ValueError(f"host {self.name!r}: simd {self.simd!r}; choose one of {sorted(SIMD_FLOPS)}")
        if self.ram_gib is not None and not (math.isfinite(self.ram_gib) and 0 < self.ram_gib < 2**20):
            raise ValueError(f"host {self.name!r}: ram={self.ram_gib!r} GiB; give a size such as 64GiB")

    def socket_bandwidth(self) -> float:
        """Peak DRAM bytes/s of one socket: channels x 8 bytes x transfers/s."""
        return self.channels * 8 * self.mts * 1e6

    def flops(self, sockets: int = 1) -> float:
        """Peak FP32 FLOP/s of `sockets` sockets."""
        return sockets * self.cores * self.ghz * 1e9 * SIMD_FLOPS[self.simd]

    def ram_bytes(self) -> float | None:
        """Installed RAM in bytes (None: not given)."""
        return None if self.ram_gib is None else self.ram_gib * 2**30

    def with_ram(self, ram_gib: float | None) -> "HostSpec":
        """The same host with `ram_gib` of RAM (None keeps what it has)."""
        import dataclasses

        return self if ram_gib is None else dataclasses.replace(self, ram_gib=ram_gib)

    def describe(self) -> str:
        """One line: memory, channels, sockets, cores, peak bandwidth."""
        ram = "" if self.ram_gib is None else f", {self.ram_gib:g} GiB RAM"
        return (f"{self.name} ({self.memory.upper()}-{self.mts:g} x{self.channels} channels x{self.sockets} "
                f"socket(s), {self.cores} cores/socket, {self.socket_bandwidth() * self.sockets / 1e9:.0f} GB/s "
                f"peak{ram})")


_AMD, _INTEL = "amd.com product page", "intel.com ark"
HOSTS: dict[str, HostSpec] = {h.name: h for h in (
    HostSpec("desktop_ddr4", "ddr4", 3200, 2, 1, 16, 3.4, "avx2", source="a 16-core desktop (Ryzen 9 5950X class)"),
    HostSpec("laptop_ddr5", "ddr5", 5600, 2, 1, 8, 3.8, "zen4", source="an 8-core laptop (Ryzen 7 7840HS class)"),
    HostSpec("server_ddr5", "ddr5", 4800, 12, 1, 32, 3.0, "zen4", source="a 32-core EPYC 9354 class server"),
    HostSpec("epyc_7343", "ddr4", 3200, 8, 1, 16, 3.2, "avx2",
             source=f"{_AMD}: EPYC 7343, 16 cores, 8 channels DDR4-3200"),
    HostSpec("epyc_7773x", "ddr4", 3200, 8, 1, 64, 2.2, "avx2", source=f"{_AMD}: EPYC 7773X, 64 cores, 8ch DDR4-3200"),
    HostSpec("epyc_7742", "ddr4", 3200, 8, 1, 64, 2.25, "avx2", source=f"{_AMD}: EPYC 7742, 64 cores, 8ch DDR4-3200"),
    HostSpec("xeon_gold_6454s", "ddr5", 4800, 8, 2, 32, 2.2, "avx512",
             source=f"{_INTEL}: Xeon Gold 6454S, 32 cores, 8ch DDR5-4800 per socket; kTransformers' 2-socket host"),
    HostSpec("xeon_gold_6126", "ddr4", 2666, 6, 2, 12, 2.6, "avx512",
             source=f"{_INTEL}: Xeon Gold 6126, 12 cores, 6ch DDR4-2666 per socket (Fiddler's Env1: 2 sockets)"),
    HostSpec("threadripper_pro_5975wx", "ddr4", 3200, 8, 1, 32, 3.6, "avx2",
             source=f"{_AMD}: Threadripper PRO 5975WX, 32 cores, 8ch DDR4-3200"),
    HostSpec("ryzen_7_5800x", "ddr4", 3200, 2, 1, 8, 3.8, "avx2",
             source=f"{_AMD}: Ryzen 7 5800X, 8 cores, 2ch DDR4-3200"),
    HostSpec("ryzen_9_5900x", "ddr4", 3200, 2, 1, 12, 3.7, "avx2",
             source=f"{_AMD}: Ryzen 9 5900X, 12 cores, 2ch DDR4-3200"),
    HostSpec("ryzen_ai_max_395", "lpddr5x", 8000, 4, 1, 16, 3.0, "zen4",
             source=f"{_AMD}: Ryzen AI MAX+ 395, 16 cores, 256-bit LPDDR5X-8000 (256 GB/s)"),
    HostSpec("i9_10900x", "ddr4", 3200, 4, 1, 10, 3.7, "avx512",
             source=f"{_INTEL}: Core i9-10900X, 10 cores, 4 channels; DDR4-3200 as the reporter's ~102 GB/s implies"),
    HostSpec("i9_9900x", "ddr4", 2666, 4, 1, 10, 3.5, "avx512", source=f"{_INTEL}: Core i9-9900X, 4ch DDR4-2666"),
    HostSpec("dgx_spark_cpu", "lpddr5x", 8533, 4, 1, 20, 3.0, "neon",
             source="nvidia.com DGX Spark: GB10, 20 Arm cores, 128 GB LPDDR5x 256-bit, 273 GB/s"),
)}

_SPEC = re.compile(r"(?P<mem>[a-z0-9]+)-(?P<mts>[0-9]+(?:\.[0-9]+)?)x(?P<ch>[0-9]+)")


def _size_gib(text: str, flag: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{flag} {text!r}: give a size with a unit, e.g. 64GiB or 128GB")
    return float(m.group(1)) * _UNITS[m.group(2).lower()] / 2**30


def parse_ram(text: str | None, flag: str = "--host-ram") -> float | None:
    """'64GiB' / '128GB' -> GiB (None stays None)."""
    if text is None:
        return None
    gib = _size_gib(str(text), flag)
    if not 0.25 <= gib < 2**20:
        raise ValueError(f"{flag} {text!r}: give the host's RAM, from 256MiB to 1PiB")
    return gib


def host_spec(text: str, flag: str = "--host") -> HostSpec:
    """A named host of `HOSTS`, or a description: ``MEMORY-MTSxCHANNELS[,sockets=N][,cores=N][,ghz=F]
    [,simd=avx2|avx512|zen4|neon|sve2][,ram=SIZE]`` (channels and cores per socket)."""
    text = str(text).strip()
    if text.lower() in HOSTS:
        return HOSTS[text.lower()]
    head, *opts = [p.strip() for p in text.lower().split(",")]
    m = _SPEC.fullmatch(head)
    usage = (f"{flag} {text!r}: give a host name ({', '.join(HOSTS)}) or a description such as ddr4-3200x2 or "
             "ddr5-4800x12,sockets=2,cores=32,ram=768GiB (memory-MT/s x channels per socket)")
    if m is None or m.group("mem") not in MEMORY_TYPES:
        raise ValueError(usage)
    kw: dict = {}
    for opt in opts:
        key, _, val = opt.partition("=")
        try:
            if key in ("sockets", "cores"):
                kw[key] = int(val)
            elif key == "ghz":
                kw[key] = float(val)
            elif key == "simd":
                kw[key] = val
            elif key == "ram":
                kw["ram_gib"] = parse_ram(val, f"{flag} ram=")
            else:
                raise ValueError(f"{flag} {text!r}: unknown field {key!r}; use sockets=, cores=, ghz=, simd=, ram=")
        except ValueError as exc:
            raise ValueError(str(exc) if str(exc).startswith(flag) else usage) from None
    try:
        return HostSpec(text, m.group("mem"), float(m.group("mts")), int(m.group("ch")), **kw)
    except ValueError as exc:
        raise ValueError(f"{flag} {text!r}: {exc}") from None
