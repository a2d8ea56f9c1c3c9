"""What every driver needs to know of a model: `ModelShape` (layers, experts, sizes, router scoring, folder).

What this file is: a frozen record of a model's shape -- enough for the memory plan, the bytes of an
expert at any precision (its up projection's rows: 2I with a gate, I without; its biases, which travel
with it and stay at full precision when the weights are packed), the FLOPs of an expert on the host, and
where the model's side files (learned probes, expert similarity) live -- built from a live model
(`from_adapter`), from a config alone with the model built on the meta device (`from_config`, no
weights), or given by hand.
What it is not: the model (`fate_lab/model/`) or a hardware profile (`fate_lab/hardware/`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fate_lab.quant import QuantSpec, expert_nbytes

SCORINGS = ("softmax", "sigmoid", "none", "score_fn")  # `model.routers.RouterSpec.scoring`


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
    intermediate: int  # routed expert width I
    dtype: torch.dtype  # the experts' dtype (the model's, unless its experts differ)
    dense_bytes: int
    kv_bytes_per_token: int
    scoring: str = "softmax"
    # the model's folder: where a learned predictor's probes and a substitute's similarity table are
    # looked up when the config names no other folder
    source: str = ""
    gated: bool = True  # the up projection holds gate and up rows (2I); False: I rows, a plain activation
    expert_bias: bool = False  # each expert has an up bias (R,) and a down bias (H,) (gpt-oss)
    expert_hidden: int | None = None  # the experts' own width where the block projects into a smaller space
    # before them (MuseSpark); None: hidden

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
        if self.scoring not in SCORINGS:
            raise ValueError(f"ModelShape.scoring={self.scoring!r}; choose one of {list(SCORINGS)}")
        for name in ("gated", "expert_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelShape.{name}={getattr(self, name)!r}: give True or False")
        eh = self.expert_hidden
        if eh is not None and (isinstance(eh, bool) or not isinstance(eh, int) or eh <= 0):
            raise ValueError(f"ModelShape.expert_hidden={eh!r}: give an int > 0, or None for hidden")

    @classmethod
    def from_adapter(cls, adapter) -> "ModelShape":
        """The shape of a model seen through `adapters.adapt(model)` (its experts may be on the meta device)."""
        layout = adapter.layouts[0]
        return cls(adapter.num_layers, adapter.num_moe_layers, adapter.num_experts, adapter.top_k,
                   adapter.hidden_size, adapter.expert_intermediate_size, layout.dtype, adapter.dense_bytes(),
                   adapter.kv_bytes_per_token(), adapter.router_spec.scoring, model_source(adapter.model),
                   gated=layout.has_gate, expert_bias=layout.has_bias,
                   expert_hidden=None if layout.hidden_size == adapter.hidden_size else layout.hidden_size)

    @classmethod
    def from_config(cls, config, dtype: torch.dtype | None = None) -> "ModelShape":
        """The shape of a model from its config alone: a `PretrainedConfig`, a `config.json` file or a checkpoint
        folder. The model is built on the meta device (no weights); only its first routers are materialised with
        random weights on the CPU, to read their scoring off the modules. dtype: the checkpoint's if None."""
        from fate_lab.model.adapters import adapt
        from fate_lab.model.meta import meta_model

        return cls.from_adapter(adapt(meta_model(config, dtype)))

    def expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """One expert's tensors in the canonical layout: gate_up (R, H), down (H, I), and with biases
        gate_up_bias (R,) and down_bias (H,) (R = 2I with a gate, I without)."""
        rows, h = 2 * self.intermediate if self.gated else self.intermediate, self.expert_width
        out: dict[str, tuple[int, ...]] = {"gate_up": (rows, h), "down": (h, self.intermediate)}
        if self.expert_bias:
            out.update(gate_up_bias=(rows,), down_bias=(h,))
        return out

    @property
    def expert_width(self) -> int:
        """H as the experts see it: `expert_hidden` where set, else `hidden`."""
        return self.expert_hidden or self.hidden

    def nbytes(self, spec: QuantSpec | None = None) -> int:
        """Bytes of one expert travelling at spec (None: full precision); biases always at full precision."""
        return expert_nbytes(self.expert_shapes(), spec, dtype=self.dtype)

    def expert_flops(self) -> float:
        """FLOPs of one routed expert on one token (up or gate-and-up, then down)."""
        rows = 2 * self.intermediate if self.gated else self.intermediate
        return 2.0 * (rows + self.intermediate) * self.expert_width

