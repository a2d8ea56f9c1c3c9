"""Routers of any experts-interface MoE model, found from its modules and called as the model calls them.

What this file is: `find_router(model, experts)` locates the router beside an experts module and the
block tensors the block passes to it (e.g. AFMoE's `expert_bias`, HY-V3's `e_score_correction_bias`);
`call_router` applies that router module itself to any gate input and returns `Routing` (what the
router returns: per-expert scores, top-k weights, top-k indices); `fit_router` reads off, by probing
the module with random gate inputs, how its scores become probabilities (softmax, sigmoid or already
probabilities), which bias steers the choice, whether weights are renormalised and scaled, and
whether the pure `select_experts` reproduces it (`RouterSpec.exact`); `HostRouter` is an exact CPU
copy of one router, for Fate's host-side cross-layer prediction; `HostRouters` holds every layer's, behind
the `scores(m, x)` interface the predictors and score-reading policies read.

What it is not: no prediction rule (`policy/predictors.py`), no expert math (`experts.py`).

Letters: T tokens, E routed experts, k experts per token, H hidden size, G expert groups.
"""

from __future__ import annotations

import copy
import inspect
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_ROUTER_CLASS = re.compile(r"Router|Gate$|TopK|Topk")
_NOT_ROUTER = re.compile(r"ForgetGate|ResidualGate|MessageGate|Experts")
# Router inputs the gate input cannot supply, named: the router needs them from elsewhere in the model.
STATE_INPUTS: dict[str, str] = {
    "router_states": "the previous MoE layer's router state (ZAYA's expert-depth attention)",
    "input_ids": "the token ids (DeepSeek-V4's hash routing)",
}


@dataclass(frozen=True)
class RouterSpec:
    """How one router picks experts, as `fit_router` reads it off the module; `select_experts` redoes it."""

    scoring: str  # "softmax" | "sigmoid" | "none" (already probabilities) | "score_fn" (the module's own)
    num_experts: int
    top_k: int
    norm_topk_prob: bool  # renormalise the k selected scores to sum to 1
    routed_scaling_factor: float  # multiplies the final weights; 1.0 when the router has none
    n_group: int | None  # group-limited selection: experts split in G contiguous groups ...
    topk_group: int | None  # ... and only the best topk_group groups may be chosen
    has_correction_bias: bool  # a bias added to the scores for the *choice* only (DeepSeek-V3 and kin)
    group_scoring: str | None = None  # "max" (DeepSeek-V2) | "top2_sum" (V3) | None: no groups
    sorted_topk: bool = True  # torch.topk(sorted=...) as the router calls it; fixes index order
    exact: bool = True  # select_experts(spec) reproduced the router's indices and weights on the probe
    linear: bool = True  # the router's scores are the gate input times its [E, H] weight (+ bias)


def select_experts(
    spec: RouterSpec, logits: torch.Tensor, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure top-k routing from router scores [T, E]: (weights [T, k] float32, indices [T, k])."""
    logits = logits.float()  # (T, E)
    scores = scores_of(spec.scoring, logits)  # (T, E)
    choice = scores if correction_bias is None else scores + correction_bias.float().reshape(-1)  # (T, E)
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


def scores_of(scoring: str, logits: torch.Tensor, router: nn.Module | None = None) -> torch.Tensor:
    """Per-expert probabilities [T, E] float32 from a router's first output under scoring.

    "score_fn" is the router module's own `score_fn` (DeepSeek-V4's sqrt-softplus): pass the router.
    """
    logits = logits.float()  # (T, E)
    if scoring == "softmax":
        return logits.softmax(dim=-1)
    if scoring == "sigmoid":
        return logits.sigmoid()
    if scoring == "none":
        return logits
    if scoring == "score_fn" and router is not None:
        return router.score_fn(logits).float()
    raise ValueError(f"scoring must be 'softmax', 'sigmoid', 'none' or 'score_fn' (with the router), got {scoring!r}")


@dataclass(frozen=True)
class Routing:
    """What a router returns for gate input [T, H], flattened to tokens."""

    scores: torch.Tensor  # (T, E') float32: the router's first output (logits, or probabilities)
    weights: torch.Tensor  # (T, k) in the router's own dtype, as the experts call receives them
    indices: torch.Tensor  # (T, k) int64


@dataclass(frozen=True, eq=False)
class RouterSite:
    """Where one MoE layer's router sits and what its block passes it besides the gate input."""

    block: nn.Module  # the module whose forward calls both the router and the experts
    router: nn.Module
    experts: nn.Module
    hidden_size: int  # H: the router's input width
    bound: tuple[str, ...]  # block attributes passed after the gate input, in the router's argument order
    missing: tuple[str, ...]  # router arguments the gate input cannot supply (see STATE_INPUTS)
    optional: tuple[str, ...]  # those of `missing` with a default (the router runs without them, stateless)
    weights: tuple[torch.Tensor, ...]  # the router's 2-D parameters (its [E, H] weight among them)
    biases: tuple[torch.Tensor, ...]  # [E] bias tensors of the router and of its bound arguments

    def weight(self) -> torch.Tensor | None:
        """The router's [E, H] weight, or None when it has none (e.g. an MLP router)."""
        E = int(self.experts.num_experts)
        return next((w for w in self.weights if tuple(w.shape) == (E, self.hidden_size)), None)


def _children(block: nn.Module, experts: nn.Module) -> list[tuple[str, nn.Module]]:
    """Direct children of block that could be its router."""
    return [(n, c) for n, c in block.named_children() if c is not experts and _ROUTER_CLASS.search(type(c).__name__)
            and not _NOT_ROUTER.search(type(c).__name__)]


def find_router(model: nn.Module, experts: nn.Module, hidden_size: int | None = None) -> RouterSite | None:
    """The RouterSite of an experts module: its router is a Router/Gate/TopK child of the same block."""
    parent = next((m for m in model.modules() if any(c is experts for c in m.children())), None)
    if parent is None:
        return None
    found = _children(parent, experts)
    if not found:
        return None
    found.sort(key=lambda nc: (nc[0] not in ("gate", "router"), nc[0]))
    router = found[0][1]
    E = int(experts.num_experts)
    H = hidden_size or int(model.config.get_text_config().hidden_size)
    bound, missing, optional = [], [], []
    for p in list(inspect.signature(router.forward).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if isinstance(getattr(parent, p.name, None), torch.Tensor):
            bound.append(p.name)
        elif p.name in STATE_INPUTS or p.default is inspect.Parameter.empty:
            missing.append(p.name)
            if p.default is not inspect.Parameter.empty:
                optional.append(p.name)
    weights = tuple(w for _, w in router.named_parameters() if w.dim() == 2)
    biases = tuple(b for n, b in [*router.named_parameters(), *router.named_buffers()]
                   if "bias" in n.rsplit(".", 1)[-1] and b.numel() == E and b.dim() <= 2)
    biases += tuple(getattr(parent, n) for n in bound if getattr(parent, n).numel() == E)
    return RouterSite(parent, router, experts, H, tuple(bound), tuple(missing), tuple(optional), weights, biases)


class MissingRouterInput(ValueError):
    """A router needs an input the gate input alone cannot supply."""


def call_router(site: RouterSite, gate_input: torch.Tensor, stateless: bool = False, **inputs) -> Routing:
    """Apply the site's router module itself to gate_input [T, H] (plus the block tensors it is given).

    A router input the gate input cannot supply (`site.missing`) must come in inputs; stateless=True
    runs a router whose such inputs have defaults without them (what its first layer does).
    """
    absent = [n for n in site.missing if n not in inputs and not (stateless and n in site.optional)]
    if absent:
        named = ", ".join(f"{n!r} ({STATE_INPUTS.get(n, 'a model input')})" for n in absent)
        raise MissingRouterInput(f"{type(site.router).__name__} needs {named} besides the gate input; pass it as "
                                 f"route(..., {absent[0]}=...) or predict this layer another way")
    x = gate_input.reshape(-1, site.hidden_size)  # (T, H)
    args = [getattr(site.block, n) for n in site.bound]
    kwargs = {n: inputs[n] for n in site.missing if n in inputs}
    if gate_input.dim() > 2:  # (B, S, H) as the block passed it: keep its shape (state inputs match it)
        out = site.router(gate_input, *args, **kwargs)
    else:
        try:
            out = site.router(x, *args, **kwargs)
        except (TypeError, ValueError, RuntimeError, IndexError):
            out = site.router(x[None], *args, **kwargs)  # routers that unpack (B, S, H), e.g. AFMoE's
    if not isinstance(out, (tuple, list)) or len(out) < 3:
        raise TypeError(f"{type(site.router).__name__} returned {type(out).__name__}; fate_lab expects the "
                        "transformers 5 router convention (scores, top-k weights, top-k indices, ...)")
    scores, weights, indices = out[0], out[1], out[2]
    T = x.shape[0]
    return Routing(scores.reshape(T, -1).float(), weights.reshape(T, -1), indices.reshape(T, -1).long())


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when every row of a and b holds the same indices in any order."""
    return a.shape == b.shape and torch.equal(a.sort(dim=-1).values, b.sort(dim=-1).values)


@dataclass(frozen=True, eq=False)
class RouterFit:
    """`fit_router`'s answer for one router: its spec and what its top-k choice ranks."""

    spec: RouterSpec
    correction_bias: torch.Tensor | None  # (E,) the tensor itself (a view of the model's), or None
    choice: str  # the scoring the bias is added to for the choice (Kolibri adds it to the raw logits)
    stateless: bool = False  # probed without a state input the router can take (see STATE_INPUTS)


def _probe(site: RouterSite, tokens: int, seed: int) -> tuple[torch.Tensor, Routing]:
    """Seeded random gate inputs [T, H] in the router's dtype and device, and what the router returns."""
    param = next(iter(site.router.parameters()), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, site.hidden_size, generator=g).to(device=device, dtype=dtype)  # (T, H)
    with torch.no_grad():
        return x, call_router(site, x, stateless=True)


def fit_router(site: RouterSite, tokens: int = 256, seed: int = 0) -> RouterFit:
    """Read a router's semantics off the module by probing it with seeded random gate inputs."""
    x, r = _probe(site, tokens, seed)
    E, k = int(site.experts.num_experts), r.indices.shape[1]
    tol = 1e-4 if r.weights.dtype == torch.float32 else 2e-2
    l, w, idx = r.scores.double(), r.weights.double(), r.indices
    live = (w != 0) & (idx < E)  # (T, k) ZAYA marks skipped slots with weight 0
    cands = {"softmax": l.softmax(-1), "sigmoid": l.sigmoid(), "none": l}
    if callable(getattr(site.router, "score_fn", None)):  # the module names its own scoring function
        cands["score_fn"] = site.router.score_fn(l.float()).double()  # tried after the usual three
    scoring, norm, scale = None, False, 1.0
    for name, p in cands.items():
        g = p.gather(1, idx.clamp(max=p.shape[1] - 1))  # (T, k)
        if (g[live] <= 0).any():
            continue
        ratio = torch.where(live, w / g, float("nan"))  # (T, k)
        lo, hi = ratio.nan_to_num(float("inf")).amin(1), ratio.nan_to_num(float("-inf")).amax(1)  # (T,)
        per_token = ratio.nanmean(1)  # (T,)
        if ((hi - lo) / per_token.abs()).max() < tol:
            scoring = name
            norm = bool((per_token.max() - per_token.min()) / per_token.abs().mean() > tol)
            scale = float(w.sum(1).mean()) if norm else float(per_token.mean())
            break
    order = ([scoring] if scoring else []) + [n for n in cands if n != scoring]
    bias, choice = None, None
    for name in order:
        for b in (None, *site.biases):
            c = cands[name] if b is None else cands[name] + b.double().reshape(-1)[: l.shape[1]]
            if _same_sets(c.topk(k, dim=-1).indices, idx):
                bias, choice = b, name
                scoring = scoring or name
                break
        if choice is not None:
            break
    choice_found = choice is not None
    router = site.router
    n_group = getattr(router, "num_group", None) or getattr(router, "n_group", None)
    topk_group = getattr(router, "topk_group", None)
    grouped = n_group is not None and int(n_group) > 1 and topk_group is not None
    if not choice_found and grouped:  # group-limited choice: the plain top-k differs; try each bias
        bias = next((b for b in site.biases), None)
    scoring = scoring or "softmax"
    choice = choice or scoring
    cands_spec = [RouterSpec(scoring, l.shape[1], k, norm, round(scale, 6), int(n_group) if grouped else None,
                             int(topk_group) if grouped else None, bias is not None, group_scoring, sorted_topk)
                  for group_scoring in (("max", "top2_sum") if grouped else (None,)) for sorted_topk in (True, False)]
    spec, exact = cands_spec[0], False
    if l.shape[1] == E:  # routers with extra score columns (shared or "skip" classes) are not modelled
        for cand in cands_spec:
            if cand.scoring == "score_fn" or choice != scoring:
                break  # select_experts models neither a module's own scoring nor a bias on another basis
            w2, i2 = select_experts(cand, r.scores, bias)
            if torch.equal(i2, idx) and torch.allclose(w2, r.weights.float(), rtol=tol, atol=tol * 1e-2):
                spec, exact = cand, True
                break
    weight = site.weight()
    lin_tol = 1e-3 if x.dtype == torch.float32 else 2e-2  # a bf16/fp16 product differs from the fp32 one by ~1e-2
    linear = weight is not None and l.shape[1] == E and scoring != "none" and torch.allclose(
        F.linear(x.float(), weight.float(), logit_bias(site)), r.scores, rtol=lin_tol, atol=lin_tol)
    spec = RouterSpec(**{**spec.__dict__, "exact": exact, "linear": bool(linear),
                         "routed_scaling_factor": round(scale, 4)})
    return RouterFit(spec, bias, choice, stateless=bool(site.optional))


def logit_bias(site: RouterSite) -> torch.Tensor | None:
    """A router's own `bias` parameter added to its logits (gpt-oss), or None."""
    b = getattr(site.router, "bias", None)
    return b.float() if isinstance(b, torch.Tensor) and b.dim() == 1 else None


class HostRouter:
    """An exact host-side copy of one layer's router: the same module class, its tensors on the CPU."""

    def __init__(self, site: RouterSite, fit: RouterFit):
        router = copy.deepcopy(site.router).to("cpu")
        for mod in router.modules():  # a copy must not fire the model's hooks (trace recorders)
            mod._forward_hooks.clear()
            mod._forward_pre_hooks.clear()
        block = nn.Module()
        for n in site.bound:
            setattr(block, n, getattr(site.block, n).detach().to("cpu").clone())
        self.site = RouterSite(block, router, site.experts, site.hidden_size, site.bound, site.missing,
                               site.optional, site.weights, site.biases)
        self.fit = fit

    @torch.no_grad()
    def __call__(self, gate_input: torch.Tensor, stateless: bool = False, **inputs) -> Routing:
        """What the layer's router returns for gate_input [T, H], computed on the CPU (stateless: see
        `call_router`)."""
        return call_router(self.site, gate_input.detach().to("cpu"), stateless=stateless, **inputs)

    def probs(self, gate_input: torch.Tensor, stateless: bool = False, **inputs) -> torch.Tensor:
        """Per-expert probabilities [T, E] float32 (Fate's predicted distribution for this layer)."""
        routing = self(gate_input, stateless=stateless, **inputs)
        scores = scores_of(self.fit.spec.scoring, routing.scores, self.site.router)  # (T, E')
        return scores[:, : int(self.site.experts.num_experts)]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the router computes in (its first parameter's)."""
        param = next(iter(self.site.router.parameters()), None)
        return param.dtype if param is not None else torch.float32


class HostRouters:
    """Every MoE layer's router on the host, for prediction and score-reading policies: `scores(m, x)`, the
    interface of `policy.rules.RouterScores`, from the model's own routers.

    A router whose scores are its gate input times an [E, H] weight (+ bias), scored by softmax or sigmoid
    (`RouterSpec.linear`), is applied as `policy.rules.next_layer_scores` computes it -- the arithmetic a
    simulator reproduces from a trace's `router_weights` and `router_biases`, so both drivers predict the same
    sets bit for bit; any other router (a norm before its projection, an MLP, its own score function) runs as
    its exact CPU copy (`HostRouter`), fed the gate input in the router's dtype. A router input the gate input
    cannot supply is left out where the router has a default for it (`stateless`, as its first layer runs);
    a layer whose router cannot run without one (hash routing on token ids) is scored by its learned
    weight alone, when it has one.
    """

    def __init__(self, routers: list[HostRouter]):
        from fate_lab.policy.rules import RouterScores

        self.routers = routers
        self._linear: list[RouterScores | None] = []
        self._weight_only: list[tuple[torch.Tensor, str, nn.Module] | None] = []
        for r in routers:
            spec, site = r.fit.spec, r.site
            weight = site.weight()
            linear = spec.linear and spec.scoring in ("softmax", "sigmoid") and weight is not None
            bias = logit_bias(site)
            self._linear.append(RouterScores([weight], spec.scoring, None if bias is None else [bias])
                                if linear else None)
            needs = set(site.missing) - set(site.optional)
            self._weight_only.append((weight.detach().float(), spec.scoring, site.router)
                                     if needs and weight is not None else None)

    def __len__(self) -> int:
        return len(self.routers)

    def is_linear(self, m: int) -> bool:
        """True when layer m's router is applied as a weight product (what a trace's router weights reproduce)."""
        return self._linear[m] is not None

    def scores(self, m: int, gate_input: torch.Tensor) -> torch.Tensor:
        """Router m's per-expert probabilities [T, E] float32 for a gate input [T, H] (layer m+1's router on
        layer m's gate input is Fate's prediction)."""
        if self._linear[m] is not None:
            return self._linear[m].scores(0, gate_input)  # (T, E)
        router = self.routers[m]
        if self._weight_only[m] is not None:
            weight, scoring, module = self._weight_only[m]
            x = gate_input.detach().to("cpu", torch.float32).reshape(-1, weight.shape[1])  # (T, H)
            return scores_of(scoring, F.linear(x, weight), module)  # (T, E)
        return router.probs(gate_input.detach().to("cpu", router.dtype), stateless=True)  # (T, E)
