"""Replacement policies by name: the one registry the configs, the runtime, the simulator and the replay read.

What this file is: `POLICIES` (name -> class) and `policy_from_name`. What it is not: a policy.
"""
from __future__ import annotations

from typing import Callable

from fate_lab.policy.replacement import ARC, Belady, LFU, LRU, ReplacementPolicy
from fate_lab.policy.replacement_scored import LRFU, RouterEMA

POLICIES: dict[str, Callable[..., ReplacementPolicy]] = {
    "lru": LRU,
    "lfu": LFU,
    "arc": ARC,
    "belady": Belady,
    "lrfu": LRFU,
    "router_ema": RouterEMA,
}


def policy_from_name(name: str, capacity: int, **kw) -> ReplacementPolicy:
    """Build a policy by name (lru, lfu, arc, belady (needs future=...), lrfu, router_ema)."""
    key = name.lower()
    if key not in POLICIES:
        raise ValueError(f"unknown replacement policy {name!r}; choose one of {sorted(POLICIES)}")
    if key == "belady" and "future" not in kw:
        raise ValueError("policy 'belady' needs future=[experts used at token t, ...] for its layer")
    return POLICIES[key](capacity, **kw)
