"""One uniform view over the transformers 5.x MoE families.

What this file is: `adapt(model)` returns an `MoEAdapter` that says which decoder layers
hold an MoE block, how that block's router turns a gate input into (weights, indices)
(`RouterSpec` + `select_experts`, a pure function), where one expert's weights live inside
the fused expert tensors, and how many bytes experts, dense weights and the KV cache take.
Every number it reproduces was checked against the installed modeling code
(`transformers/models/<family>/modeling_<family>.py`, 5.24).

What it is not: it moves no weights, patches no module and runs no offloading; the store,
transfer engine and offloaded block use it to find things. It does not load checkpoints.

Letters: T tokens, E routed experts, k experts per token, H hidden size, I expert
intermediate size, G expert groups.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED_FAMILIES: tuple[str, ...] = (
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "mixtral",
    "deepseek_v2",
    "deepseek_v3",
)


@dataclass(frozen=True)
class RouterSpec:
    """How one family's router picks experts; enough for `select_experts` to redo it."""

    scoring: str  # "softmax" | "sigmoid": the per-expert score the router ranks
    num_experts: int
    top_k: int
    norm_topk_prob: bool  # renormalise the k selected scores to sum to 1
    routed_scaling_factor: float  # multiplies the final weights; 1.0 when the family has none
    n_group: int | None  # group-limited selection: experts split in G contiguous groups ...
    topk_group: int | None  # ... and only the best topk_group groups may be chosen
    has_correction_bias: bool  # DeepSeek-V3: bias added to scores for *choice* only
    group_scoring: str | None = None  # "max" (DeepSeek-V2) | "top2_sum" (V3) | None: no groups
    sorted_topk: bool = True  # torch.topk(sorted=...) as HF calls it; fixes index order


def select_experts(
    spec: RouterSpec, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure top-k routing from router logits [T, E]: (weights [T, k] float32, indices [T, k])."""
    logits = logits.float()  # (T, E)
    scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()  # (T, E)
    choice = scores if correction_bias is None else scores + correction_bias.float()  # (T, E)
    if spec.group_scoring is not None:
        n_tok, n_exp, n_grp = choice.shape[0], spec.num_experts, spec.n_group
        grouped = choice.view(n_tok, n_grp, n_exp // n_grp)  # (T, G, E/G)
        if spec.group_scoring == "max":
            group_scores = grouped.max(dim=-1).values  # (T, G)
            fill = 0.0  # DeepSeek-V2 zeroes the scores of dropped groups
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (T, G)
            fill = float("-inf")  # DeepSeek-V3 makes dropped groups unchoosable
        group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]  # (T, topk_group)
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # (T, G)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_grp, n_exp // n_grp).reshape(-1, n_exp)  # (T, E)
        choice = choice.masked_fill(~score_mask.bool(), fill)  # (T, E)
    indices = torch.topk(choice, k=spec.top_k, dim=-1, sorted=spec.sorted_topk)[1]  # (T, k)
    weights = scores.gather(1, indices)  # (T, k)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)  # (T, k)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor  # (T, k)
    return weights, indices


@dataclass(frozen=True)
class _FamilyFacts:
    """What differs between families, read off each modeling file."""

    scoring: str = "softmax"
    logits_fp32: bool = False  # router casts input and weight to float32 before the matmul
    weights_to_logit_dtype: bool = False  # top-k weights cast back to the logits' dtype
    norm_topk: str = "config"  # "config": config.norm_topk_prob | "always" | "never"
    has_scaling: bool = False  # config.routed_scaling_factor applies
    groups: str | None = None  # None | "v2" (topk_method switch, max) | "v3" (top2 sum, bias)
    sorted_topk: bool = True
    shared: str | None = None  # None | "qwen2" (shared_expert + sigmoid gate) | "deepseek"
    mla: bool = False  # KV cache holds the compressed MLA latent


_QWEN_LIKE = _FamilyFacts(weights_to_logit_dtype=True)
_FAMILY_FACTS: dict[str, _FamilyFacts] = {
    "qwen2_moe": _FamilyFacts(weights_to_logit_dtype=True, shared="qwen2"),
    "qwen3_moe": _QWEN_LIKE,
    "olmoe": _QWEN_LIKE,
    "mixtral": _FamilyFacts(norm_topk="always"),
    "deepseek_v2": _FamilyFacts(
        logits_fp32=True, norm_topk="never", has_scaling=True, groups="v2", sorted_topk=False,
        shared="deepseek", mla=True,
    ),
    "deepseek_v3": _FamilyFacts(
        scoring="sigmoid", logits_fp32=True, has_scaling=True, groups="v3", sorted_topk=False,
        shared="deepseek", mla=True,
    ),
}


def _router_spec(facts: _FamilyFacts, config, num_experts: int, top_k: int) -> RouterSpec:
    """Build the RouterSpec of one family from its config."""
    norm = {"always": True, "never": False}.get(facts.norm_topk, bool(getattr(config, "norm_topk_prob", False)))
    n_group = topk_group = group_scoring = None
    if facts.groups == "v3" or (facts.groups == "v2" and config.topk_method == "group_limited_greedy"):
        n_group, topk_group = int(config.n_group), int(config.topk_group)
        group_scoring = "top2_sum" if facts.groups == "v3" else "max"
    return RouterSpec(
        scoring=facts.scoring,
        num_experts=num_experts,
        top_k=top_k,
        norm_topk_prob=norm,
        routed_scaling_factor=float(config.routed_scaling_factor) if facts.has_scaling else 1.0,
        n_group=n_group,
        topk_group=topk_group,
        has_correction_bias=facts.groups == "v3",
        group_scoring=group_scoring,
        sorted_topk=facts.sorted_topk,
    )


def _is_moe_block(mlp: nn.Module) -> bool:
    """True for a block with a router (`gate.weight`) and fused experts."""
    experts = getattr(mlp, "experts", None)
    return hasattr(getattr(mlp, "gate", None), "weight") and hasattr(experts, "gate_up_proj")


class MoEAdapter:
    """Uniform access to one HF MoE *ForCausalLM; `m` is always the MoE-layer index."""

    def __init__(self, model: nn.Module):
        config = model.config
        self.family: str = config.model_type
        self.model = model
        self._facts = _FAMILY_FACTS[self.family]
        self._layers = getattr(model, "model", model).layers
        self.moe_layers: list[int] = [i for i, layer in enumerate(self._layers) if _is_moe_block(layer.mlp)]
        if not self.moe_layers:
            raise ValueError(
                f"{type(model).__name__} ({self.family}) has no MoE layer; "
                f"fate_lab supports MoE models of the families {SUPPORTED_FAMILIES}"
            )
        self.num_moe_layers: int = len(self.moe_layers)
        first = self.block(0)
        self.num_experts: int = first.gate.weight.shape[0]
        self.top_k: int = int(first.gate.top_k)
        self.hidden_size: int = first.gate.weight.shape[1]
        self.expert_intermediate_size: int = first.experts.gate_up_proj.shape[1] // 2
        self.router_spec: RouterSpec = _router_spec(self._facts, config, self.num_experts, self.top_k)
        self.has_shared_experts: bool = self._facts.shared is not None

    # --- where things are -------------------------------------------------------------
    def block(self, m: int) -> nn.Module:
        """The MoE block (`layer.mlp`) of MoE layer m."""
        return self._layers[self.moe_layers[m]].mlp

    def router_weight(self, m: int) -> torch.Tensor:
        """Router weight [E, H] of MoE layer m."""
        return self.block(m).gate.weight

    def experts_module(self, m: int) -> nn.Module:
        """The fused experts module of MoE layer m."""
        return self.block(m).experts

    def correction_bias(self, m: int) -> torch.Tensor | None:
        """DeepSeek-V3 `e_score_correction_bias` [E] of MoE layer m, else None."""
        return self.block(m).gate.e_score_correction_bias if self.router_spec.has_correction_bias else None

    # --- routing ----------------------------------------------------------------------
    def route_logits(self, m: int, gate_input: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E] (float32) from gate input [T, H], computed as the model does."""
        weight = self.router_weight(m)  # (E, H)
        x = gate_input.reshape(-1, self.hidden_size)  # (T, H)
        if self._facts.logits_fp32:
            return F.linear(x.float(), weight.float())  # (T, E)
        return F.linear(x.to(weight.dtype), weight).float()  # (T, E) matmul in the router dtype, as HF does

    def select(self, m: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], indices [T, k]) from logits, exactly as the model's router does."""
        weights, indices = select_experts(self.router_spec, logits, self.correction_bias(m))  # (T, k)
        if self._facts.weights_to_logit_dtype:
            weights = weights.to(self.router_weight(m).dtype)  # (T, k) HF casts to the logits' dtype
        return weights, indices

    def route(self, m: int, gate_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [T, E], weights [T, k], indices [T, k]) for gate input [T, H]."""
        logits = self.route_logits(m, gate_input)  # (T, E)
        weights, indices = self.select(m, logits)  # (T, k)
        return logits, weights, indices

    def scores(self, m: int, logits: torch.Tensor) -> torch.Tensor:
        """Per-expert scores [T, E] the router ranks (softmax or sigmoid probs, no bias)."""
        logits = logits.float()  # (T, E)
        return logits.softmax(dim=-1) if self.router_spec.scoring == "softmax" else logits.sigmoid()

    def gate_input_hook(self, m: int, fn: Callable[[int, torch.Tensor], None]):
        """Call fn(m, gate_input [T, H]) before router m runs; returns the removable handle."""
        hidden = self.hidden_size

        def pre_hook(_module: nn.Module, args: tuple) -> None:
            fn(m, args[0].reshape(-1, hidden))  # (T, H)

        return self.block(m).gate.register_forward_pre_hook(pre_hook)

    # --- expert math ------------------------------------------------------------------
    def expert_weights(self, m: int, e: int) -> dict[str, torch.Tensor]:
        """{"gate": [I, H], "up": [I, H], "down": [H, I]}: views into the fused tensors."""
        experts, inter = self.experts_module(m), self.expert_intermediate_size
        gate_up = experts.gate_up_proj[e]  # (2I, H) gate rows stacked over up rows
        return {"gate": gate_up[:inter], "up": gate_up[inter:], "down": experts.down_proj[e]}

    def expert_forward(self, m: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """Unweighted output [T, H] of expert e: act(x @ gate.T) * (x @ up.T) @ down.T."""
        w = self.expert_weights(m, e)
        act = self.experts_module(m).act_fn
        h = act(F.linear(x, w["gate"])) * F.linear(x, w["up"])  # (T, I)
        return F.linear(h, w["down"])  # (T, H)

    def shared_forward(self, m: int, x: torch.Tensor) -> torch.Tensor | None:
        """Shared-expert output [T, H] incl. Qwen2-MoE's sigmoid gate; None without shared experts."""
        block = self.block(m)
        if self._facts.shared == "qwen2":
            return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)  # (T, H)
        if self._facts.shared == "deepseek":
            return block.shared_experts(x)  # (T, H)
        return None

    # --- sizes --------------------------------------------------------------------------
    def bytes_per_expert(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one routed expert's gate, up and down weights (default: the param dtype)."""
        dtype = dtype or self.experts_module(0).gate_up_proj.dtype
        return 3 * self.expert_intermediate_size * self.hidden_size * _itemsize(dtype)

    def expert_bytes_total(self) -> int:
        """Bytes of all routed experts' fused weights over all MoE layers."""
        return sum(_nbytes(p) for p in self._expert_params())

    def dense_bytes(self) -> int:
        """Bytes of every parameter that is not a routed expert (tied embeddings counted once)."""
        expert_ids = {id(p) for p in self._expert_params()}
        return sum(_nbytes(p) for p in self.model.parameters() if id(p) not in expert_ids)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """KV-cache bytes one token adds over all layers, as HF's DynamicCache stores it.

        Sliding-window caches (Mixtral with `sliding_window`) stop growing at the window;
        this is the per-token cost below it. DeepSeek (MLA): the latent + rope key per layer.
        """
        config, item = self.model.config, _itemsize(dtype or self.model.dtype)
        if self._facts.mla:  # HF caches the compressed latent and the rope key, one "head"
            per_layer = config.kv_lora_rank + config.qk_rope_head_dim
        else:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            per_layer = 2 * config.num_key_value_heads * head_dim
        return len(self._layers) * per_layer * item

    def describe(self) -> dict:
        """A plain summary for notebooks: family, layers, experts, router semantics, bytes."""
        return {
            "family": self.family,
            "num_layers": len(self._layers),
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "hidden_size": self.hidden_size,
            "expert_intermediate_size": self.expert_intermediate_size,
            "has_shared_experts": self.has_shared_experts,
            "router": asdict(self.router_spec),
            "bytes_per_expert": self.bytes_per_expert(),
            "expert_bytes_total": self.expert_bytes_total(),
            "dense_bytes": self.dense_bytes(),
            "kv_bytes_per_token": self.kv_bytes_per_token(),
        }

    def _expert_params(self) -> list[nn.Parameter]:
        """The fused routed-expert parameters of every MoE layer."""
        mods = [self.experts_module(m) for m in range(self.num_moe_layers)]
        return [p for mod in mods for p in (mod.gate_up_proj, mod.down_proj)]


def _itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of dtype."""
    return torch.empty((), dtype=dtype).element_size()


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of tensor t."""
    return t.numel() * t.element_size()


OFFLOAD_MARK = "_fate_offloaded"  # the attribute a Runtime attaches to every experts module it serves


def is_offloaded(model: nn.Module) -> bool:
    """True if a fate_lab Runtime is attached to the model's experts right now."""
    return any(hasattr(mod, OFFLOAD_MARK) for mod in model.modules())


def adapt(model: nn.Module) -> MoEAdapter:
    """The MoEAdapter for an HF MoE model; ValueError for an unknown family or a non-MoE model."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in _FAMILY_FACTS:
        raise ValueError(
            f"model_type {family!r} is not a supported MoE family; "
            f"fate_lab supports {SUPPORTED_FAMILIES} (load one of those or add its facts to adapters.py)"
        )
    return MoEAdapter(model)
