"""Disks that hold the weights a host's RAM cannot: named profiles and `--disk` specs.

What this file is: `Disk` (a `LinkProfile` of a storage device with its read queue, and the page cache's
read-ahead window over it), `DISKS` (the rated sequential rate x 0.45 for Gen4/Gen5 NVMe, HOBBIT's practical
expert reads, as `links.py` says; ~100 us access latency; up to 32 reads in flight; the engine's threads, one
fault each, fill the queue; Linux's default 128 KiB window), and `disk(text)`: a name, or
``bw=3.5GBps,lat=100us,qd=32,ra=128KiB``. A disk-bound part streams at `LinkProfile.stream_bandwidth(read)`
with one read per read-ahead window: the read size, not the rated rate, sets it (small reads are latency-bound).
What it is not: the link to the GPU (`links.py`) or where the reads come from (`static_speed.py`).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from fate_lab.hardware.links import LINK_PROFILES, LinkProfile

READAHEAD_BYTES = 128 << 10  # Linux's default read-ahead window (VM_READAHEAD_PAGES, include/linux/mm.h): what
# `/sys/block/<dev>/queue/read_ahead_kb` holds unless the distribution or the driver sets another (this machine's
# virtio disk: 8 MiB). An mmap'd file's page fault reads that window around the faulting page
# (do_sync_mmap_readahead's read-around in mm/filemap.c: start = fault - window / 2), and a fault on a page the
# window marked reads the next one ahead: experts computed straight from a mapping are read in windows, not in
# 4 KiB pages. The kernel stops read-around for a file whose faults keep missing their windows (mmap_miss >
# MMAP_LOTSAMISS); an expert's weights are read through in order, so its windows are used. Measured here
# (benchmarks/results/big_disk_*.md): 220 major faults for a run that read gigabytes through a mapping.


@dataclass(frozen=True)
class Disk(LinkProfile):
    """A disk as a link (`LinkProfile`) and the page cache's read-ahead window over it (bytes an mmap fault reads)."""

    readahead: int = READAHEAD_BYTES

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.readahead, int) and self.readahead >= 4096):
            raise ValueError(f"disk {self.name!r}: readahead={self.readahead!r} bytes; give an int >= 4096")


NVME_QUEUE = 32
DISKS: dict[str, Disk] = {
    "nvme": Disk(**{**dataclasses.asdict(LINK_PROFILES["nvme"]), "queue_depth": NVME_QUEUE}),
    "nvme_gen4": Disk(**{**dataclasses.asdict(LINK_PROFILES["nvme_gen4"]), "queue_depth": NVME_QUEUE}),
    "nvme_gen5": Disk(**{**dataclasses.asdict(LINK_PROFILES["nvme_gen5"]), "queue_depth": NVME_QUEUE}),
    "sata_ssd": Disk("SATA SSD", 0.53e9, 100e-6, "SATA III 600 MB/s line rate; ~530 MB/s rated reads",
                            queue_depth=NVME_QUEUE),
    "hdd": Disk("7200 rpm hard disk", 0.2e9, 8e-3, "~200 MB/s sequential, ~8 ms seek + rotation"),
}
_UNIT = {"gbps": 1e9, "mbps": 1e6, "us": 1e-6, "ms": 1e-3, "s": 1.0, "kib": 1 << 10, "mib": 1 << 20}


def disk(text: str, flag: str = "--disk") -> Disk:
    """A named disk, or ``bw=GBps,lat=us,qd=N,ra=KiB`` (bandwidth in GB/s or MB/s, latency in us or ms, queue,
    the read-ahead window in KiB or MiB: `/sys/block/<dev>/queue/read_ahead_kb`, default 128 KiB)."""
    t = str(text).strip().lower()
    if t in DISKS:
        return DISKS[t]
    usage = (f"{flag} {text!r}: give a disk name ({', '.join(DISKS)}) or a spec such as "
             "bw=3.5GBps,lat=100us,qd=32,ra=128KiB")
    fields: dict = {}
    for part in t.split(","):
        key, _, val = part.partition("=")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", val.strip())
        if m is None:
            raise ValueError(usage)
        num, unit = float(m.group(1)), m.group(2)
        if key == "bw" and unit in ("gbps", "mbps"):
            fields["bandwidth"] = num * _UNIT[unit]
        elif key == "lat" and unit in ("us", "ms", "s"):
            fields["latency"] = num * _UNIT[unit]
        elif key == "qd" and unit == "" and num == int(num) and num >= 1:
            fields["queue_depth"] = int(num)
        elif key == "ra" and unit in ("kib", "mib") and num * _UNIT[unit] >= 4096:
            fields["readahead"] = int(num * _UNIT[unit])
        else:
            raise ValueError(usage)
    if "bandwidth" not in fields:
        raise ValueError(usage)
    try:
        return Disk(f"disk {text}", fields["bandwidth"], fields.get("latency", 100e-6), "--disk spec",
                    queue_depth=fields.get("queue_depth", 1), readahead=fields.get("readahead", READAHEAD_BYTES))
    except ValueError as exc:
        raise ValueError(f"{flag} {text!r}: {exc}") from None
