"""A model's weights counted by tensor class and layer, and their bytes at a weight format.

What this file is: `LayerParams` (one decoder layer: the parameters of each non-expert tensor class, its routed
experts and the size of one, the KV cache one token adds) and `ModelParams` (every layer, the embeddings, the LM
head, top-k, the attention's grouping), with the byte sums the memory plan and the speed model read:
`dense_bytes(fmt, i)`, `expert_bytes(fmt, i)`, `embed_bytes`, `head_bytes`, `total_bytes`.
What it is not: the counting of a real model (`fate_lab/core/costs.py:model_params` walks a meta-device model)
or a speed (`static_speed.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

from fate_lab.hardware.formats import WeightFormat


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's weights."""

    dense: tuple[tuple[str, int], ...]  # (tensor class, parameters) of everything but the routed experts
    experts: int = 0  # routed experts (0: a dense layer)
    expert_gate_up: int = 0  # parameters of ONE routed expert's gate and up projections
    expert_down: int = 0  # ... of its down projection
    expert_bias: int = 0  # ... of its biases (kept as stored)
    kv_bytes_per_token: float = 0.0  # KV cache one token adds to this layer (at the cache's dtype)

    def dense_params(self) -> int:
        """Parameters of the non-expert part."""
        return sum(n for _, n in self.dense)

    def expert_params(self) -> int:
        """Parameters of one routed expert (biases included)."""
        return self.expert_gate_up + self.expert_down + self.expert_bias


@dataclass(frozen=True)
class ModelParams:
    """A model's weights by class and layer."""

    name: str
    layers: tuple[LayerParams, ...]
    embed: int
    head: int  # 0: tied to the embeddings
    other: int  # final norm and the like
    top_k: int
    hidden: int
    gqa: int = 1  # query heads per KV head (llama.cpp's n_gqa, which some mixes test)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_experts(self) -> int:
        """Routed experts per MoE layer (the largest)."""
        return max((lay.experts for lay in self.layers), default=0)

    def _bits(self, fmt: WeightFormat, cls: str, i: int) -> float:
        return fmt.bits(cls, i, self.n_layers, self.n_experts, self.gqa)

    def dense_bytes(self, fmt: WeightFormat, i: int) -> float:
        """Bytes of layer i's non-expert weights at fmt."""
        return sum(n * self._bits(fmt, cls, i) / 8 for cls, n in self.layers[i].dense)

    def expert_bytes(self, fmt: WeightFormat, i: int) -> float:
        """Bytes of one routed expert of layer i at fmt (0 for a dense layer)."""
        lay = self.layers[i]
        return (lay.expert_gate_up * self._bits(fmt, "exps_gate_up", i) + lay.expert_down
                * self._bits(fmt, "exps_down", i) + lay.expert_bias * self._bits(fmt, "exps_bias", i)) / 8

    def embed_bytes(self, fmt: WeightFormat) -> float:
        """Bytes of the token embeddings."""
        return self.embed * fmt.bits("embed", -1, self.n_layers, self.n_experts, self.gqa) / 8

    def head_bytes(self, fmt: WeightFormat) -> float:
        """Bytes of the LM head read once per forward (the embeddings when tied)."""
        if self.head == 0:
            return self.embed_bytes(fmt)
        return self.head * fmt.bits("head", -1, self.n_layers, self.n_experts, self.gqa) / 8 + self.other * 4

    def total_bytes(self, fmt: WeightFormat) -> float:
        """Every weight at fmt: the file a loader reads."""
        layers = sum(self.dense_bytes(fmt, i) + self.layers[i].experts * self.expert_bytes(fmt, i)
                     for i in range(self.n_layers))
        return layers + self.embed_bytes(fmt) + (self.head_bytes(fmt) if self.head else self.other * 4)

    def active_params(self) -> int:
        """Parameters one decode token reads: every dense weight, top-k experts a MoE layer, the head."""
        return sum(lay.dense_params() + min(self.top_k, lay.experts) * lay.expert_params()
                   for lay in self.layers) + (self.head or self.embed)
