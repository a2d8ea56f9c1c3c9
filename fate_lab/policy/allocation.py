"""Per-layer expert-slot allocation: "how many cache slots does each MoE layer get?".

Pure policies over ints. Every allocator has ``allocate(cache_total, num_layers, num_experts)
-> list[int]`` with each entry <= num_experts, the sum <= cache_total, and everyone at
num_experts when ``cache_total >= num_layers * num_experts``.

- ``UniformAllocation``: an even split (remainder to the shallowest layers).
- ``ShallowFavoringAllocation``: Fate — shallow layers 0..L-1 first (their routing is flat and
  hard to predict), the rest evenly over the deep layers.
- ``MissCurveAllocation``: ours — the allocation that minimises the total misses predicted by
  per-layer miss curves measured on a calibration trace (exact dynamic programme).

Not here: measuring miss curves with prefetching (``fate_lab.sim.replay.miss_curves``) and turning
bytes into slots (``fate_lab.policy.planner``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor


def _check(cache_total: int, num_layers: int, num_experts: int) -> None:
    if cache_total < 0 or num_layers <= 0 or num_experts <= 0:
        raise ValueError(
            f"need cache_total >= 0, num_layers > 0, num_experts > 0; got {cache_total}, {num_layers}, {num_experts}"
        )


def _even_split(total: int, n: int, cap: int) -> list[int]:
    """Split ``total`` over ``n`` bins of at most ``cap``, remainder to the first bins."""
    if n == 0:
        return []
    base = min(cap, total // n)
    out = [base] * n
    if base < cap:
        for i in range(total - base * n):
            out[i] += 1
    return out


@dataclass(frozen=True)
class UniformAllocation:
    """The same number of slots for every layer; the remainder goes to the shallowest layers."""

    def allocate(self, cache_total: int, num_layers: int, num_experts: int) -> list[int]:
        """Slots per layer."""
        _check(cache_total, num_layers, num_experts)
        return _even_split(cache_total, num_layers, num_experts)


@dataclass(frozen=True)
class ShallowFavoringAllocation:
    """Fate: layers ``0..shallow_layers-1`` get ``min(E, remaining)`` slots each, in order;
    what remains is split evenly over the deep layers (remainder to the shallowest deep ones)."""

    shallow_layers: int  # the paper's L: 3 or 4 on Qwen1.5-MoE

    def allocate(self, cache_total: int, num_layers: int, num_experts: int) -> list[int]:
        """Slots per layer."""
        _check(cache_total, num_layers, num_experts)
        if self.shallow_layers < 0:
            raise ValueError(f"shallow_layers must be >= 0, got {self.shallow_layers}")
        shallow = min(self.shallow_layers, num_layers)
        out, remaining = [], cache_total
        for _ in range(shallow):
            s = min(num_experts, remaining)
            out.append(s)
            remaining -= s
        return out + _even_split(remaining, num_layers - shallow, num_experts)


def lru_miss_curves(experts: Tensor, num_experts: int) -> list[list[int]]:
    """Misses of an LRU cache of each capacity 0..E, per layer, in one pass (stack distances).

    ``experts [N, L, k]``. Updates recency in the input order of a token's experts, so it equals
    a replay that touches them in that order; ``fate_lab.sim.replay`` follows the runtime's order (a
    token's hits before its misses) and differs from it by a few misses per thousand uses. ``curves[l][c]`` =
    misses of layer l with c slots.
    """
    ex = torch.as_tensor(experts)
    N, L, k = ex.shape
    curves = []
    for l in range(L):
        stack: list[int] = []  # most recent first
        depth_hist = [0] * (num_experts + 1)  # depth_hist[d] = re-uses found at stack depth d
        for row in ex[:, l].tolist():
            # the replay protects a token's own experts, so a token hits exactly the experts
            # whose depth at the token's start is < c; then they move to the front in order
            for e in row:
                if e in stack:
                    depth_hist[stack.index(e)] += 1
            for e in row:
                if e in stack:
                    stack.remove(e)
                stack.insert(0, e)
        total = N * k
        curve, hits = [], 0
        for c in range(num_experts + 1):
            curve.append(total - hits)  # an access at depth d hits iff c > d
            if c < num_experts:
                hits += depth_hist[c]
        curves.append(curve)
    return curves


@dataclass(frozen=True)
class MissCurveAllocation:
    """Minimise total predicted misses given per-layer miss curves (exact DP over layers).

    ``curves[l][c]`` = misses of layer l with c slots, c = 0..E (from ``lru_miss_curves`` or
    ``fate_lab.sim.replay.miss_curves``, which includes prefetching). Unlike a greedy marginal-gain
    allocator it is optimal on non-convex curves (a layer whose working set only fits at 6
    slots gains nothing from 3). Slots that reduce no misses are then handed out evenly, so the
    cache is never left empty for nothing.
    """

    curves: tuple[tuple[float, ...], ...]

    def __init__(self, curves: Sequence[Sequence[float]]):
        object.__setattr__(self, "curves", tuple(tuple(float(x) for x in c) for c in curves))

    @classmethod
    def from_trace(cls, experts: Tensor, num_experts: int) -> "MissCurveAllocation":
        """Calibrate on a routing trace ``[N, L, k]`` with LRU demand-loading miss curves."""
        return cls(lru_miss_curves(experts, num_experts))

    def allocate(self, cache_total: int, num_layers: int, num_experts: int) -> list[int]:
        """Slots per layer minimising the sum of miss curves (ties: fewer slots to deeper layers)."""
        _check(cache_total, num_layers, num_experts)
        if len(self.curves) != num_layers:
            raise ValueError(f"calibrated for {len(self.curves)} layers, asked for {num_layers}")
        if any(len(c) < num_experts + 1 for c in self.curves):
            raise ValueError(f"each miss curve needs entries for 0..{num_experts} slots")
        B = min(cache_total, num_layers * num_experts)
        # best[b] = min misses of the layers seen so far using at most b slots
        best = torch.zeros(B + 1, dtype=torch.float64)
        choice: list[list[int]] = []
        for l in range(num_layers):
            curve = self.curves[l]
            cand = torch.full((num_experts + 1, B + 1), float("inf"), dtype=torch.float64)  # (c, b)
            for c in range(min(num_experts, B) + 1):
                cand[c, c:] = best[: B + 1 - c] + curve[c]
            best = cand.min(0).values  # (B+1,)
            choice.append((cand <= best + 1e-9).to(torch.uint8).argmax(0).tolist())  # first (fewest) c
        out, b = [0] * num_layers, B
        for l in range(num_layers - 1, -1, -1):
            out[l] = choice[l][b]
            b -= out[l]
        spare = B - sum(out)
        while spare > 0:  # hand out useless-but-free slots round-robin, shallow first
            for l in range(num_layers):
                if spare and out[l] < num_experts:
                    out[l] += 1
                    spare -= 1
        return out


ALLOCATIONS = {"uniform": UniformAllocation, "shallow": ShallowFavoringAllocation, "miss_curve": MissCurveAllocation}


def allocation_from_name(name: str, **params):
    """Build an allocator by name: uniform, shallow(shallow_layers), miss_curve(curves)."""
    if name not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {name!r}; choose one of {sorted(ALLOCATIONS)}")
    return ALLOCATIONS[name](**params)
