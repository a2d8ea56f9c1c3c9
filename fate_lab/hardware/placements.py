"""Where each part of a model lives, as data: llama.cpp's placement flags, names kept.

What this file is: `Placement` (`-ngl N` / `--n-gpu-layers N`: the last N decoder layers on the GPU, the rest,
attention included, on the CPU; `--n-cpu-moe N`: the routed experts of the first N layers on the CPU; `--cpu-moe`:
every routed expert on the CPU; CPU-only: nothing on a GPU), and `Placement.layout(n_layers)`, the one generic
rule that turns the flags into (dense on the GPU?, experts on the GPU?) per layer and the LM head's place. As in
llama.cpp (`llama_model::load_tensors`: layers from `n_layer - n_gpu_layers` on are offloaded, the output layer
when `n_gpu_layers > n_layer`; `--n-cpu-moe` adds tensor-buffer overrides `blk\\.N\\.ffn_(up|down|gate)_exps`
for N below the count, so shared experts stay where their layer is), the token embeddings stay on the CPU.
What it is not: a speed model (`static_speed.py`) or the runtime's per-miss host/device choice
(`fate_lab/policy/placement.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

ALL = 10**6  # -ngl 999: every layer and the output


@dataclass(frozen=True)
class Layout:
    """Per decoder layer: (dense part on the GPU, routed experts on the GPU); and the LM head's place."""

    layers: tuple[tuple[bool, bool], ...]
    head_on_gpu: bool


@dataclass(frozen=True)
class Placement:
    """llama.cpp's placement flags as data."""

    n_gpu_layers: int = ALL
    n_cpu_moe: int = 0
    cpu_moe: bool = False

    def __post_init__(self) -> None:
        for f, flag in (("n_gpu_layers", "-ngl"), ("n_cpu_moe", "--n-cpu-moe")):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{flag} {v!r}: give a whole number >= 0")

    @property
    def cpu_only(self) -> bool:
        """Nothing on a GPU (-ngl 0)."""
        return self.n_gpu_layers == 0

    def layout(self, n_layers: int) -> Layout:
        """Where each layer's dense part and routed experts live, and the head (llama.cpp's rule)."""
        first_gpu = max(0, n_layers - self.n_gpu_layers)
        rows = []
        for i in range(n_layers):
            dense = i >= first_gpu
            experts = dense and not self.cpu_moe and i >= self.n_cpu_moe
            rows.append((dense, experts))
        return Layout(tuple(rows), self.n_gpu_layers > n_layers)

    def flags(self, n_layers: int | None = None) -> str:
        """The llama.cpp command-line flags of this placement."""
        if self.cpu_only:
            return "-ngl 0"
        ngl = "-ngl 999" if self.n_gpu_layers >= ALL else f"-ngl {self.n_gpu_layers}"
        if self.cpu_moe or (n_layers is not None and self.n_cpu_moe >= n_layers):
            return f"{ngl} --cpu-moe"
        return ngl + (f" --n-cpu-moe {self.n_cpu_moe}" if self.n_cpu_moe else "")

    def describe(self, n_layers: int) -> str:
        """In words: how many layers and expert layers sit on the GPU."""
        lay = self.layout(n_layers)
        dense = sum(d for d, _ in lay.layers)
        experts = sum(e for _, e in lay.layers)
        return (f"{dense}/{n_layers} layers on the GPU, routed experts of {experts} on the GPU, head on the "
                f"{'GPU' if lay.head_on_gpu else 'CPU'}")
