"""The replacement policies by name: the one list the configs, the runtime, the simulator and the replay read.

What this file is: `POLICIES` (name -> `kernels.record.Policy`), built from `_FILES`, one line per policy file of
`policy/kernels/`, and `policy_from_name`. Nothing else lists policies (tests/policy/test_registry.py checks).
What it is not: a policy.
"""
from __future__ import annotations

import importlib

from fate_lab.policy.compiled import CompiledPolicy
from fate_lab.policy.kernels.record import Policy

_FILES = (  # the modules of fate_lab/policy/kernels/ that hold a policy, in the order the replay numbers them
    "lru",
    "arc",
    "lfu",
    "lrfu",
    "belady",
    "s3fifo",
    "sieve",
    "lirs",
    "lecar",
    "least_stale",
    "router_ema",
    "clock",
)

POLICIES: dict[str, Policy] = {}
for _f in _FILES:
    _p = importlib.import_module(f"fate_lab.policy.kernels.{_f}").POLICY
    POLICIES[_p.name] = _p


def policy_names(*kinds: str) -> tuple[str, ...]:
    """The names of the registered policies of these kinds (none given: all), in the registry's order."""
    return tuple(n for n, p in POLICIES.items() if not kinds or p.kind in kinds)


def policy_record(name: str) -> Policy:
    """The record of a policy by name (case-insensitive), or one error naming the known ones."""
    key = name.lower() if isinstance(name, str) else name
    if key not in POLICIES:
        raise ValueError(f"unknown replacement policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[key]


def policy_from_name(name: str, capacity: int, num_experts: int | None = None, **kw) -> CompiledPolicy:
    """Build a policy by name for one layer of `capacity` slots over expert ids 0..num_experts-1 (default: up to
    1024 ids). A policy that reads the future needs future=[experts used at token t, ...] for its layer."""
    rec = policy_record(name)
    future = kw.pop("future", None)
    if rec.reads_future and future is None:
        raise ValueError(f"policy {rec.name!r} needs future=[experts used at token t, ...] for its layer")
    if future is not None and not rec.reads_future:
        raise TypeError(f"policy {rec.name!r} does not read the future; drop future=")
    return CompiledPolicy(rec, capacity, num_experts, future=future, **kw)
