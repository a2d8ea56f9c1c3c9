"""Replacement policies by name: the one registry the configs, the runtime, the simulator and the replay read.

What this file is: `POLICIES` (name -> class) and `policy_from_name`. What it is not: a policy.
"""
from __future__ import annotations

from typing import Callable

from fate_lab.policy.replacement import ARC, LFU, LRU, Belady, ReplacementPolicy
from fate_lab.policy.replacement_field import LIRS, S3FIFO, SIEVE
from fate_lab.policy.replacement_lecar import LeCaR
from fate_lab.policy.replacement_moe import LeastStale
from fate_lab.policy.replacement_scored import LRFU, RouterEMA

POLICIES: dict[str, Callable[..., ReplacementPolicy]] = {
    "lru": LRU,
    "lfu": LFU,
    "arc": ARC,
    "belady": Belady,
    "lrfu": LRFU,
    "router_ema": RouterEMA,
    "s3fifo": S3FIFO,  # the caching field's policies (replacement_field.py)
    "sieve": SIEVE,
    "lirs": LIRS,
    "lecar": LeCaR,
    "least_stale": LeastStale,  # for MoE experts, after SpecMD (replacement_moe.py)
}


def policy_from_name(name: str, capacity: int, **kw) -> ReplacementPolicy:
    """Build a policy by name (lru, lfu, arc, belady (needs future=...), lrfu, router_ema, s3fifo, sieve, lirs,
    lecar, least_stale)."""
    key = name.lower()
    if key not in POLICIES:
        raise ValueError(f"unknown replacement policy {name!r}; choose one of {sorted(POLICIES)}")
    if key == "belady" and "future" not in kw:
        raise ValueError("policy 'belady' needs future=[experts used at token t, ...] for its layer")
    return POLICIES[key](capacity, **kw)
