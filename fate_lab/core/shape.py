"""What every driver needs to know of a model: `ModelShape` (layers, experts, sizes, router scoring, folder).

What this file is: a frozen record of a model's shape -- enough for the memory plan, the bytes of an
expert at any precision, the FLOPs of an expert on the host, and where the model's side files (learned
probes, expert similarity) live -- built from a live model (`from_adapter`) or given by hand.
What it is not: the model (`fate_lab/model/`) or a hardware profile (`fate_lab/hardware/`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fate_lab.quant import QuantSpec, expert_nbytes


def model_source(model) -> str:
    """The folder a loaded model came from ('' for one built in memory): its probes and tables live there."""
    return str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")


@dataclass(frozen=True)
class ModelShape:
    """What a driver needs to know of a model (sizes for bytes and the plan)."""

    num_layers: int  # decoder layers (dense and MoE)
    num_moe_layers: int
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int  # routed expert width
    dtype: torch.dtype
    dense_bytes: int
    kv_bytes_per_token: int
    scoring: str = "softmax"
    # the model's folder: where a learned predictor's probes and a substitute's similarity table are
    # looked up when the config names no other folder
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_moe_layers", "num_experts", "top_k", "hidden", "intermediate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelShape.{name}={v!r}: give an int > 0")
        for name in ("dense_bytes", "kv_bytes_per_token"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"ModelShape.{name}={v!r} bytes: give an int >= 0")
        if self.num_moe_layers > self.num_layers:
            raise ValueError(f"ModelShape: {self.num_moe_layers} MoE layers but only {self.num_layers} decoder layers")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"ModelShape.top_k={self.top_k}: needs 0 < top_k <= num_experts ({self.num_experts})")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"ModelShape.scoring={self.scoring!r}; choose 'softmax' or 'sigmoid'")

    @classmethod
    def from_adapter(cls, adapter) -> "ModelShape":
        """The shape of a model seen through `adapters.adapt(model)`."""
        gu = adapter.experts_module(0).gate_up_proj
        return cls(len(getattr(adapter.model, "model", adapter.model).layers), adapter.num_moe_layers,
                   adapter.num_experts, adapter.top_k, adapter.hidden_size, adapter.expert_intermediate_size,
                   gu.dtype if gu.numel() else adapter.model.dtype, adapter.dense_bytes(), adapter.kv_bytes_per_token(),
                   adapter.router_spec.scoring, model_source(adapter.model))

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        """gate_up (2I, H) and down (H, I)."""
        return {"gate_up": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}

    def nbytes(self, spec: QuantSpec | None = None) -> int:
        """Bytes of one expert travelling at spec (None: full precision)."""
        return expert_nbytes(self.expert_shapes(), spec, dtype=self.dtype)

    def expert_flops(self) -> float:
        """FLOPs of one routed expert on one token (gate, up and down projections)."""
        return 2.0 * 3 * self.hidden * self.intermediate
