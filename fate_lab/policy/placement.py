"""Where a routed expert computes: in a device slot (after a transfer) or on the host, where it lives.

What this file is: `HostPlacement`, the pure decision the expert cache asks for each expert a
layer needs and does not hold: compute it on the host (no slot, no transfer) or load it. Two
kinds, after the systems that compute experts on the CPU:
- "cost" (Fiddler, DAOP): per expert and step, the host when its time for the n tokens that need
  the expert is below one transfer of the expert's weights. A decode token (n = 1) makes the host
  win for every miss on a slow link; a long prefill step (large n) makes the transfer win.
- "layers" (llama.cpp `--n-cpu-moe N`; kTransformers with every layer): the routed experts of the
  first N MoE layers live and compute on the host, always; those layers get no device slots.
What it is not: it measures nothing and knows no clock; `host_s(n)` and `transfer_s` come from the
driver (`offloading/host.py` profiles, the link profile), the same numbers in runtime and simulator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

HOST_MODES = ("cost", "layers")


def host_layer_set(mode: str | None, host_layers: int, num_layers: int) -> frozenset[int]:
    """MoE layers whose experts always compute on the host: the first `host_layers` ("layers" mode;
    -1: all of them, as kTransformers); none otherwise."""
    if mode != "layers":
        return frozenset()
    n = num_layers if host_layers < 0 else min(host_layers, num_layers)
    return frozenset(range(n))


@dataclass(frozen=True, eq=False)
class HostPlacement:
    """Host-or-device for an expert that is not resident (semantics in the module docstring)."""

    mode: str  # "cost" | "layers"
    host_layers: frozenset[int]  # always on the host
    host_s: Callable[[int], float]  # seconds of one expert on the host for n tokens
    transfer_s: float  # seconds one transfer of an expert takes on the link (0: instant link)

    def __post_init__(self):
        if self.mode not in HOST_MODES:
            raise ValueError(f"host placement mode {self.mode!r}; choose one of {list(HOST_MODES)}")

    def layer_on_host(self, m: int) -> bool:
        """Every expert of MoE layer m computes on the host."""
        return m in self.host_layers

    def on_host(self, m: int, n: int) -> bool:
        """A non-resident expert of layer m needed by n tokens of this step computes on the host."""
        if m in self.host_layers:
            return True
        return self.mode == "cost" and self.host_s(n) < self.transfer_s
