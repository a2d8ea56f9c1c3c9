"""One uniform view over every transformers MoE model whose experts use the experts interface.

What this file is: `adapt(model)` returns an `MoEAdapter` that finds, from the model's own modules,
which decoder layers hold an experts module (a class decorated with `@use_experts_implementation`),
the router beside each (`routers.find_router`), each experts module's declared layout
(`experts.layout_of`), and how many bytes experts, dense weights and the KV cache take. Routing is
the model's: `route(m, x)` applies layer m's own router module to any gate input x, so `probs(m + 1,
gate input of layer m)` is Fate's cross-layer prediction for any family; `host_router(m)` is an
exact CPU copy for the host side. Expert math is `experts.expert_apply` on `expert(m, e)`.

What it is not: it moves no weights, patches no module and runs no offloading; the store, transfer
engine and offloaded block use it to find things. Checkpoints are `checkpoint.py`.

Facts kept per family: none here; the few the modules cannot answer are named in `experts.py`
(accumulation dtypes) and `routers.py` (router inputs the gate input cannot supply).

Letters: T tokens, E routed experts, k experts per token, H hidden size, I expert intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace

import torch
from torch import nn

from fate_lab.model.experts import (
    ExpertLayout,
    ExpertWeights,
    expert_apply,
    expert_refusal,
    is_experts_module,
    layout_of,
    read_expert,
)
from fate_lab.model.routers import (
    HostRouter,
    HostRouters,
    MissingRouterInput,
    RouterFit,
    RouterSite,
    RouterSpec,
    call_router,
    find_router,
    fit_router,
    scores_of,
    select_experts,
)

__all__ = ["SUPPORTED_FAMILIES", "MoEAdapter", "RouterSpec", "adapt", "experts_modules", "select_experts"]

# The families with hand-picked tiny presets that every runtime test runs on; `adapt` serves any model
# whose modeling uses the experts interface (`testing.experts_interface_families()` lists them).
SUPPORTED_FAMILIES: tuple[str, ...] = (
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "mixtral",
    "deepseek_v2",
    "deepseek_v3",
)
_SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp")  # the block's always-on experts
_TOP_K_NAMES = ("num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk", "moe_k")


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(name, ModuleList) of the text decoder layers: the shortest-named `layers` list of the right length."""
    n = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    lists = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(mod) > 0]
    right = [nl for nl in lists if len(nl[1]) == n] or lists
    if not right:
        raise ValueError(f"{type(model).__name__} has no decoder `layers` list; fate_lab adapts decoder MoE LMs")
    return min(right, key=lambda nl: (nl[0].count("."), nl[0]))


def experts_modules(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(decoder layer index, module path, module) of every experts module in the text decoder layers, in order."""
    name, _ = _decoder_layers(model)
    return [(int(path[len(name) + 1:].split(".", 1)[0]), path, mod) for path, mod in model.named_modules()
            if is_experts_module(mod) and path.startswith(name + ".")]


class MoEAdapter:
    """Uniform access to one HF MoE *ForCausalLM; `m` is always the MoE-layer index."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.family: str = model.config.model_type
        _, self._layers = _decoder_layers(model)
        self.num_layers: int = len(self._layers)
        found = [(i, mod) for i, _, mod in experts_modules(model)]  # (decoder index, experts module)
        if not found:
            raise ValueError(
                f"{type(model).__name__} ({self.family}) has no MoE layer: no module of its decoder layers uses "
                f"transformers' experts interface; fate_lab serves MoE models that do, e.g. the families "
                f"{SUPPORTED_FAMILIES} (fate_lab.model.testing.experts_interface_families() lists all)")
        self.moe_layers: list[int] = [i for i, _ in found]
        self._experts: list[nn.Module] = [mod for _, mod in found]
        hidden = int(model.config.get_text_config().hidden_size)
        self._sites: list[RouterSite] = []
        for m, mod in enumerate(self._experts):
            site = find_router(model, mod, hidden)
            if site is None:
                raise ValueError(f"{self.family}: no router found beside {type(mod).__name__} of decoder layer "
                                 f"{self.moe_layers[m]} (looked for a Router/Gate/TopK child of its block)")
            self._sites.append(site)
        self.layouts: list[ExpertLayout] = [layout_of(mod) for mod in self._experts]
        self._fits: dict[int, RouterFit] = {}
        self.num_moe_layers: int = len(self.moe_layers)
        self.num_experts: int = self.layouts[0].num_experts
        self.hidden_size: int = hidden
        self.expert_intermediate_size: int = self.layouts[0].intermediate_size
        self.top_k: int = self._top_k()
        self.has_shared_experts: bool = self.shared_module(0) is not None

    def _top_k(self) -> int:
        """k: the router's `top_k`, else the config's, else what the router returns on a probe."""
        top_k = getattr(self._sites[0].router, "top_k", None)
        if isinstance(top_k, int):
            return top_k
        config = self.model.config.get_text_config()
        named = next((getattr(config, n) for n in _TOP_K_NAMES if isinstance(getattr(config, n, None), int)), None)
        return named if named is not None else self.router_spec.top_k

    # --- where things are -------------------------------------------------------------
    def block(self, m: int) -> nn.Module:
        """The module that calls MoE layer m's router and experts (`layer.mlp` in most families)."""
        return self._sites[m].block

    def router(self, m: int) -> nn.Module:
        """The router module of MoE layer m."""
        return self._sites[m].router

    def router_site(self, m: int) -> RouterSite:
        """Where MoE layer m's router sits and what its block passes it."""
        return self._sites[m]

    def router_weight(self, m: int) -> torch.Tensor:
        """Router weight [E, H] of MoE layer m; ValueError for a router without one (e.g. an MLP router)."""
        weight = self._sites[m].weight()
        if weight is None:
            raise ValueError(f"{self.family}: the router of MoE layer {m} ({type(self.router(m)).__name__}) has "
                             f"no [E, H] weight; use route(m, x) / host_router(m), which call the module itself")
        return weight

    def experts_module(self, m: int) -> nn.Module:
        """The experts module of MoE layer m."""
        return self._experts[m]

    def correction_bias(self, m: int) -> torch.Tensor | None:
        """The bias that steers layer m's choice but not its weights (e.g. `e_score_correction_bias`), or None."""
        return self.fit(m).correction_bias

    # --- routing ----------------------------------------------------------------------
    def fit(self, m: int) -> RouterFit:
        """What `routers.fit_router` reads off layer m's router (cached)."""
        if m not in self._fits:
            self._fits[m] = fit_router(self._sites[m])
        return self._fits[m]

    @property
    def router_spec(self) -> RouterSpec:
        """The RouterSpec of the first MoE layer whose router the gate input alone can drive."""
        m = next((m for m, s in enumerate(self._sites) if set(s.missing) <= set(s.optional)), 0)
        return self.fit(m).spec

    def route(self, m: int, gate_input: torch.Tensor, **inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores [T, E] float32, weights [T, k], indices [T, k]): layer m's router module on gate_input [T, H]."""
        with torch.no_grad():
            r = call_router(self._sites[m], gate_input, **inputs)
        return r.scores, r.weights, r.indices

    def probs(self, m: int, gate_input: torch.Tensor, **inputs) -> torch.Tensor:
        """Per-expert probabilities [T, E] float32 of layer m's router on gate_input [T, H] (Fate's predictor
        reads `probs(m + 1, gate input of layer m)`)."""
        return self.scores(m, self.route(m, gate_input, **inputs)[0])

    def scores(self, m: int, logits: torch.Tensor) -> torch.Tensor:
        """Per-expert probabilities [T, E] from the router's first output (softmax, sigmoid or as is; no bias)."""
        return scores_of(self.fit(m).spec.scoring, logits, self.router(m))[..., : self.num_experts]

    def choice_scores(self, m: int, gate_input: torch.Tensor, **inputs) -> torch.Tensor:
        """What layer m's top-k ranks [T, E] float32: its scores on the choice basis plus the steering bias
        (before any group limit); top-k of this is the router's choice where it has no groups."""
        fit = self.fit(m)
        s = scores_of(fit.choice, self.route(m, gate_input, **inputs)[0], self.router(m))[..., : self.num_experts]
        return s if fit.correction_bias is None else s + fit.correction_bias.float().reshape(-1)

    def select(self, m: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], indices [T, k]) from the router's first output, by the pure `select_experts`.

        Only where `fit(m).spec.exact` (select_experts reproduced the router on the probe); otherwise
        NotImplementedError: call `route(m, gate_input)`, which runs the module itself.
        """
        fit = self.fit(m)
        if not fit.spec.exact:
            raise NotImplementedError(f"{self.family}: select_experts does not model the router of MoE layer {m} "
                                      f"({type(self.router(m)).__name__}); use route(m, gate_input)")
        weights, indices = select_experts(fit.spec, logits, fit.correction_bias)
        return weights.to(self._weights_dtype(m)), indices

    def _weights_dtype(self, m: int) -> torch.dtype:
        """The dtype layer m's router returns its top-k weights in."""
        param = next(iter(self.router(m).parameters()))
        x = torch.zeros(1, self.hidden_size, dtype=param.dtype, device=param.device)  # (1, H)
        return self.route(m, x)[1].dtype

    def host_router(self, m: int) -> HostRouter:
        """An exact CPU copy of layer m's router (module class, weights and bound block tensors)."""
        return HostRouter(self._sites[m], self.fit(m))

    def host_routers(self) -> HostRouters:
        """Every MoE layer's router on the host (`routers.HostRouters`): Fate's prediction for layer m + 1 is
        `scores(m + 1, gate input of layer m)`. A router that cannot be probed without an input the gate input
        cannot supply (hash routing on token ids) gets the model's router spec, marked neither exact nor linear."""
        out = []
        for m, site in enumerate(self._sites):
            try:
                fit = self.fit(m)
            except MissingRouterInput:
                fit = RouterFit(replace(self.router_spec, exact=False, linear=False), None, self.router_spec.scoring)
            out.append(HostRouter(site, fit))
        return HostRouters(out)

    def gate_input_hook(self, m: int, fn: Callable[[int, torch.Tensor], None]):
        """Call fn(m, gate_input [T, H]) before router m runs; returns the removable handle."""
        hidden = self.hidden_size

        def pre_hook(_module: nn.Module, args: tuple) -> None:
            fn(m, args[0].reshape(-1, hidden))  # (T, H)

        return self.router(m).register_forward_pre_hook(pre_hook)

    # --- expert math ------------------------------------------------------------------
    def expert(self, m: int, e: int) -> ExpertWeights:
        """Expert e of MoE layer m: canonical weights, views into the module's tensors."""
        return read_expert(self._experts[m], e)

    def expert_weights(self, m: int, e: int) -> dict[str, torch.Tensor]:
        """Compatibility view {"gate": [I, H], "up": [I, H], "down": [H, I]} of a gated, concatenated,
        bias-free expert; NotImplementedError for other layouts (use `expert(m, e)`)."""
        layout, w = self.layouts[m], self.expert(m, e)
        if not (layout.has_gate and layout.is_concatenated and not layout.has_bias):
            raise NotImplementedError(f"{self.family}: {layout.experts_class} is not a [gate; up] bias-free layout; "
                                      "use expert(m, e) (ExpertWeights) and experts.expert_apply")
        inter = layout.intermediate_size
        return {"gate": w.gate_up[:inter], "up": w.gate_up[inter:], "down": w.down}

    def expert_forward(self, m: int, e: int, x: torch.Tensor) -> torch.Tensor:
        """Unweighted output [T, H] of expert e of MoE layer m on x [T, H], as the eager forward computes it."""
        return expert_apply(self._experts[m], x, self.expert(m, e))

    def shared_module(self, m: int) -> nn.Module | None:
        """The shared-experts module of MoE layer m's block (`shared_expert(s)`, `shared_mlp`), or None."""
        return next((getattr(self.block(m), n) for n in _SHARED_NAMES
                     if isinstance(getattr(self.block(m), n, None), nn.Module)), None)

    def shared_forward(self, m: int, x: torch.Tensor) -> torch.Tensor | None:
        """Shared-expert output [T, H] (with Qwen2-MoE's sigmoid `shared_expert_gate` when the block has one);
        None without shared experts. How the block combines it with the routed sum is the block's own."""
        shared = self.shared_module(m)
        if shared is None:
            return None
        gate = getattr(self.block(m), "shared_expert_gate", None)
        out = shared(x)  # (T, H)
        return out if gate is None else torch.sigmoid(gate(x)) * out

    def refusal(self) -> str | None:
        """Why this model's experts cannot be served (family, layout, what to do), or None."""
        return next((r for mod in self._experts if (r := expert_refusal(mod, self.family)) is not None), None)

    # --- sizes --------------------------------------------------------------------------
    def bytes_per_expert(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one routed expert's weights and biases (default: the module's dtype)."""
        return self.layouts[0].bytes_per_expert(dtype)

    def expert_bytes_total(self) -> int:
        """Bytes of all routed experts' tensors over all MoE layers."""
        return sum(_nbytes(p) for p in self._expert_params())

    def dense_bytes(self) -> int:
        """Bytes of every parameter that is not a routed expert (tied embeddings counted once)."""
        expert_ids = {id(p) for p in self._expert_params()}
        return sum(_nbytes(p) for p in self.model.parameters() if id(p) not in expert_ids)

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """KV-cache bytes one token adds over the attention layers, as HF's DynamicCache stores it.

        Sliding-window layers stop growing at the window; this is the per-token cost below it.
        MLA families (a `kv_lora_rank`): the latent + rope key per layer. Layers whose `layer_types`
        entry is not an attention type (linear attention, state space, conv) hold fixed-size state. Exact for the
        families `test_kv_bytes_per_token_matches_the_cache` checks; an estimate for the others.
        """
        config, item = self.model.config.get_text_config(), _itemsize(dtype or self.model.dtype)
        # the cache holds num_hidden_layers layers: LongCat-Flash's decoder layers hold two attention blocks each
        types = getattr(config, "layer_types", None) or ["attention"] * int(getattr(config, "num_hidden_layers", None)
                                                                             or len(self._layers))
        per_layer = getattr(config, "per_layer_config", None)  # a heterogeneous config: each layer's own sizes
        return item * sum(_kv_per_layer(per_layer[i] if per_layer else config) for i, t in enumerate(types)
                          if "attention" in str(t) and "linear" not in str(t))

    def describe(self) -> dict:
        """A plain summary for notebooks: family, layers, experts, layout, router semantics, bytes."""
        layout = self.layouts[0]
        return {
            "family": self.family,
            "num_layers": self.num_layers,
            "moe_layers": list(self.moe_layers),
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "hidden_size": self.hidden_size,
            "expert_intermediate_size": self.expert_intermediate_size,
            "has_shared_experts": self.has_shared_experts,
            "experts_class": layout.experts_class,
            "layout": {k: v for k, v in asdict(layout).items() if k.startswith(("has_", "is_", "custom", "accum"))},
            "router_class": type(self.router(0)).__name__,
            "router": asdict(self.router_spec),
            "router_needs": sorted({n for s in self._sites for n in s.missing}),
            "bytes_per_expert": self.bytes_per_expert(),
            "expert_bytes_total": self.expert_bytes_total(),
            "dense_bytes": self.dense_bytes(),
            "kv_bytes_per_token": self.kv_bytes_per_token(),
            "refusal": self.refusal(),
        }

    def _expert_params(self) -> list[torch.Tensor]:
        """The routed-expert tensors of every MoE layer (weights and biases)."""
        return [p for mod in self._experts for n, p in mod.named_parameters(recurse=False)]


def _kv_per_layer(config) -> int:
    """Elements one token adds to one attention layer's cache: keys + values, or MLA's latent + rope key."""
    if getattr(config, "kv_lora_rank", None):  # HF caches the compressed latent and the rope key
        return config.kv_lora_rank + config.qk_rope_head_dim
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * kv_heads * head_dim


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
    """The MoEAdapter of an HF MoE model; ValueError for a model without experts-interface MoE layers."""
    if getattr(getattr(model, "config", None), "model_type", None) is None:
        raise ValueError(f"{type(model).__name__} is not a transformers model (no config.model_type); fate_lab "
                         f"adapts transformers MoE models, e.g. the families {SUPPORTED_FAMILIES}")
    if is_offloaded(model):
        raise RuntimeError("this model is offloaded by a fate_lab Runtime: its experts live in the runtime's store, "
                           "not in the model; adapt the model before offload(), or after close()")
    return MoEAdapter(model)
