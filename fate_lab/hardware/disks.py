"""Disks that hold the weights a host's RAM cannot: named profiles and `--disk` specs.

What this file is: `DISKS`, each a `LinkProfile` of a storage device with its read queue (the rated sequential
rate x 0.45 for Gen4/Gen5 NVMe, HOBBIT's practical expert reads, as `links.py` says; ~100 us access latency;
up to 32 reads in flight; the engine's threads, one fault each, fill the queue), and `disk(text)`: a name, or
``bw=3.5GBps,lat=100us,qd=32``. A disk-bound part streams at `LinkProfile.stream_bandwidth(read_bytes)`: the
read size, not the rated rate, sets it (small reads are latency-bound).
What it is not: the link to the GPU (`links.py`) or where the reads come from (`static_speed.py`).
"""
from __future__ import annotations

import dataclasses
import re

from fate_lab.hardware.links import LINK_PROFILES, LinkProfile

MMAP_READ_BYTES = 4096  # one page: a thrashing mmap'd file reads single pages. Linux's do_sync_mmap_readahead
# (mm/filemap.c) stops its 128 KiB read-around once a file's faults miss far more than they hit (mmap_miss >
# MMAP_LOTSAMISS), which is the state of weights larger than RAM read at random; llama.cpp mmaps its GGUF
NVME_QUEUE = 32
DISKS: dict[str, LinkProfile] = {
    "nvme": dataclasses.replace(LINK_PROFILES["nvme"], queue_depth=NVME_QUEUE),
    "nvme_gen4": dataclasses.replace(LINK_PROFILES["nvme_gen4"], queue_depth=NVME_QUEUE),
    "nvme_gen5": dataclasses.replace(LINK_PROFILES["nvme_gen5"], queue_depth=NVME_QUEUE),
    "sata_ssd": LinkProfile("SATA SSD", 0.53e9, 100e-6, "SATA III 600 MB/s line rate; ~530 MB/s rated reads",
                            queue_depth=NVME_QUEUE),
    "hdd": LinkProfile("7200 rpm hard disk", 0.2e9, 8e-3, "~200 MB/s sequential, ~8 ms seek + rotation"),
}
_UNIT = {"gbps": 1e9, "mbps": 1e6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def disk(text: str, flag: str = "--disk") -> LinkProfile:
    """A named disk, or ``bw=GBps,lat=us,qd=N`` (bandwidth in GB/s or MB/s, latency in us or ms, queue)."""
    t = str(text).strip().lower()
    if t in DISKS:
        return DISKS[t]
    usage = (f"{flag} {text!r}: give a disk name ({', '.join(DISKS)}) or a spec such as "
             "bw=3.5GBps,lat=100us,qd=32")
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
        else:
            raise ValueError(usage)
    if "bandwidth" not in fields:
        raise ValueError(usage)
    try:
        return LinkProfile(f"disk {text}", fields["bandwidth"], fields.get("latency", 100e-6), "--disk spec",
                           queue_depth=fields.get("queue_depth", 1))
    except ValueError as exc:
        raise ValueError(f"{flag} {text!r}: {exc}") from None
