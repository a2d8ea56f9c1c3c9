"""Expert math for every experts layout that transformers' experts interface declares.

What this file is: `ExpertLayout` (what one experts module declares with `@use_experts_implementation`
— `has_gate`, `has_bias`, `is_transposed`, `is_concatenated`, `has_post_expert_norm` — plus its
sizes and the two facts its flags do not carry, read off the installed release's eager forward by
`eager_facts`), `ExpertWeights` (one expert's canonical tensors), `read_expert` (one expert out of the
fused module tensors), `expert_apply` (what transformers' eager experts forward computes for one
expert, before the routing weight), `combine_experts` (the eager forward's weighted sum), and why a
module cannot be served: `expert_refusal` (what it holds) and `math_refusal` (fate_lab's math against
the installed eager forward, bit for bit on a probe: a transformers release that changes a family's
expert computation is refused with the reason, never computed differently in silence).

What it is not: no routing (`routers.py`), no checkpoint reading (`checkpoint.py`), no movement.

Letters: n tokens of one expert, T tokens, k experts per token, E experts, H hidden, I expert
intermediate, R = 2I rows of the up projection with a gate (gate and up in the module's own row
order, so the module's `_apply_gate` works unchanged), R = I without a gate.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

_WEIGHT_NAMES = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
PROBE_TOKENS = 4  # tokens of `math_refusal`'s probe, routed to experts 0 and 1


def eager_forward(cls: type) -> Callable:
    """The eager forward the experts interface dispatches for an experts class: the `__wrapped__` original of
    the forward `@use_experts_implementation` decorated (a subclass may wrap it in a forward of its own)."""
    for klass in cls.__mro__:
        forward = klass.__dict__.get("forward")
        if forward is not None and hasattr(forward, "__wrapped__"):
            return forward.__wrapped__
    raise TypeError(f"{cls.__name__} has no forward decorated by transformers' @use_experts_implementation")


@functools.lru_cache(maxsize=None)
def eager_facts(cls: type) -> tuple[str, bool, frozenset[str] | None]:
    """(accumulate, compute_fp32, the `self.` attributes it reads) of cls's eager forward, read off its source in
    the installed transformers: accumulate "float32" (`zeros_like(hidden_states, dtype=torch.float32)`),
    "weights" (`dtype=top_k_weights.dtype`) or "output" (the hidden dtype); compute_fp32 when it multiplies
    `.float() @`. Without the source: ("output", False, None); `math_refusal` checks the numbers either way."""
    try:
        src = inspect.getsource(eager_forward(cls))
    except (OSError, TypeError):
        return "output", False, None
    first = next((line for line in src.splitlines() if "zeros_like(hidden_states" in line), "")
    accumulate = "float32" if "torch.float32" in first else "weights" if "top_k_weights.dtype" in first else "output"
    return accumulate, ".float() @" in src, frozenset(re.findall(r"self\.(\w+)", src))


@dataclass(frozen=True)
class ExpertLayout:
    """How one experts module stores and computes its experts (its declared flags and sizes)."""

    experts_class: str
    num_experts: int  # E
    hidden_size: int  # H
    intermediate_size: int  # I
    has_gate: bool  # gate_up_proj [E, 2I, H] (gated) or up_proj [E, I, H] (plain activation)
    has_bias: bool  # *_proj_bias tensors travel with their expert
    is_transposed: bool  # stored [E, H, R] / [E, I, H]: the eager forward multiplies x @ W
    is_concatenated: bool  # gate rows over up rows; False: interleaved (the module's _apply_gate splits)
    has_post_expert_norm: bool  # module.post_expert_norm after the down projection
    custom_gate: bool  # the class defines its own _apply_gate (e.g. gpt-oss's clamped SwiGLU)
    dtype: torch.dtype
    accumulate: str  # "output" (hidden dtype) | "float32" | "weights" (routing weights' dtype)
    compute_fp32: bool

    @property
    def up_name(self) -> str:
        """Name of the up (or gate-and-up) projection tensor."""
        return "gate_up_proj" if self.has_gate else "up_proj"

    def tensor_names(self) -> dict[str, str]:
        """{ExpertWeights field: the experts module's tensor name}, e.g. gate_up -> up_proj without a gate."""
        names = {"gate_up": self.up_name, "down": "down_proj"}
        if self.has_bias:
            names.update(gate_up_bias=f"{self.up_name}_bias", down_bias="down_proj_bias")
        return names

    @property
    def rows(self) -> int:
        """R: rows of one expert's canonical up projection."""
        return 2 * self.intermediate_size if self.has_gate else self.intermediate_size

    def bytes_per_expert(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one expert's weights and biases (default: the module's dtype)."""
        elems = self.rows * self.hidden_size + self.hidden_size * self.intermediate_size
        if self.has_bias:
            elems += self.rows + self.hidden_size
        return elems * torch.empty((), dtype=dtype or self.dtype).element_size()


@dataclass(frozen=True)
class ExpertWeights:
    """One expert's canonical weights: what `expert_apply` needs and a slot or the host stores."""

    gate_up: torch.Tensor  # (R, H) the module's own row order
    down: torch.Tensor  # (H, I)
    gate_up_bias: torch.Tensor | None = None  # (R,)
    down_bias: torch.Tensor | None = None  # (H,)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that exist, by field name."""
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def nbytes(self) -> int:
        """Bytes of all of this expert's tensors (biases included)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ExpertWeights:
        """On device and/or in dtype, each tensor keeping its memory layout (so the math stays bit-exact)."""
        return replace(self, **{k: v.to(device=device, dtype=dtype) for k, v in self.tensors().items()})

    def contiguous(self) -> ExpertWeights:
        """Standalone contiguous copies (for a slot or a store; transposed views become row-major)."""
        return replace(self, **{k: v.detach().clone().contiguous() for k, v in self.tensors().items()})

    def equal(self, other: ExpertWeights) -> bool:
        """True when both hold the same tensors bit for bit."""
        mine, theirs = self.tensors(), other.tensors()
        return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def is_experts_module(mod: nn.Module) -> bool:
    """True for a module built by a class decorated with `@use_experts_implementation`."""
    return hasattr(mod, "has_gate") and hasattr(mod, "is_transposed") and hasattr(mod, "_is_expert_parallel")


def layout_of(mod: nn.Module) -> ExpertLayout:
    """The ExpertLayout of an experts module (sizes from its tensors, or its attributes once emptied)."""
    if not is_experts_module(mod):
        raise TypeError(f"{type(mod).__name__} is not an experts module: its class is not decorated with "
                        "transformers' @use_experts_implementation")
    name = type(mod).__name__
    up, down = getattr(mod, "gate_up_proj" if mod.has_gate else "up_proj"), mod.down_proj
    if down.dim() == 3:
        num, hidden, inter = (down.shape[0], down.shape[2], down.shape[1]) if mod.is_transposed else down.shape
    else:  # emptied by an offloading runtime: the module's own attributes still say
        num = int(mod.num_experts)
        hidden = int(getattr(mod, "hidden_dim", None) or mod.hidden_size)
        inter = int(getattr(mod, "intermediate_dim", None) or mod.intermediate_size)
    accumulate, compute_fp32, _ = eager_facts(type(mod))
    return ExpertLayout(
        experts_class=name, num_experts=int(num), hidden_size=int(hidden), intermediate_size=int(inter),
        has_gate=bool(mod.has_gate), has_bias=bool(mod.has_bias), is_transposed=bool(mod.is_transposed),
        is_concatenated=bool(mod.is_concatenated), has_post_expert_norm=bool(mod.has_post_expert_norm),
        custom_gate=getattr(type(mod)._apply_gate, "__name__", "") != "_default_apply_gate", dtype=up.dtype,
        accumulate=accumulate,
        compute_fp32=compute_fp32,
    )


def read_expert(mod: nn.Module, e: int) -> ExpertWeights:
    """Expert e's canonical weights: views into the module's tensors (transposed layouts as `.T` views)."""
    layout = layout_of(mod)
    if not 0 <= e < layout.num_experts:
        raise IndexError(f"expert {e} out of range: {layout.experts_class} holds {layout.num_experts} experts")
    up, down = getattr(mod, layout.up_name)[e], mod.down_proj[e]  # (R, H) | (H, R), (H, I) | (I, H)
    if layout.is_transposed:
        up, down = up.T, down.T  # (R, H), (H, I) views: F.linear(x, up) computes x @ W as the eager forward
    up_bias = getattr(mod, f"{layout.up_name}_bias")[e] if layout.has_bias else None  # (R,)
    down_bias = mod.down_proj_bias[e] if layout.has_bias else None  # (H,)
    return ExpertWeights(up, down, up_bias, down_bias)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T, then + bias as a separate add (the eager forwards and batched_mm add it apart)."""
    y = F.linear(x, weight)
    return y if bias is None else y + bias


def expert_apply(mod: nn.Module, x: torch.Tensor, w: ExpertWeights, post_norm: bool = True) -> torch.Tensor:
    """Unweighted output [n, H] of one expert on x [n, H], as transformers' eager forward computes it.

    up (+ bias) -> the module's `_apply_gate` (or `act_fn` without a gate) -> down (+ bias) -> the
    module's `post_expert_norm` when declared (post_norm=False leaves it to the caller, e.g. to run it
    where the module's norm weights live). The routing weight is NOT applied: the eager forwards multiply it
    after all of this (`combine_experts` does; `math_refusal` checks it against the installed release).
    """
    compute_fp32 = eager_facts(type(mod))[1]  # the class's facts only: the module's tensors may be emptied
    if compute_fp32:
        x, w = x.float(), w.to(dtype=torch.float32)
    h = _linear(x, w.gate_up, w.gate_up_bias)  # (n, R)
    h = mod._apply_gate(h) if mod.has_gate else mod.act_fn(h)  # (n, I)
    if compute_fp32:
        h = h.float()
    y = _linear(h, w.down, w.down_bias)  # (n, H)
    if mod.has_post_expert_norm and post_norm:
        y = mod.post_expert_norm(y)  # (n, H)
    return y


def combine_experts(
    mod: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    weights_of: Callable[[int], ExpertWeights] | None = None,
) -> torch.Tensor:
    """The experts call [T, H] from hidden [T, H] and routing [T, k], summed as the eager forward sums.

    weights_of(e) gives expert e's weights (default: `read_expert(mod, e)`); index entries outside
    [0, E) are skipped, as the eager forwards skip them.
    """
    layout = layout_of(mod)
    weights_of = weights_of or (lambda e: read_expert(mod, e))
    acc = {"float32": torch.float32, "weights": top_k_weights.dtype}.get(layout.accumulate, hidden.dtype)
    out = torch.zeros(hidden.shape, dtype=acc, device=hidden.device)  # (T, H)
    for e in top_k_index.unique().tolist():
        if not 0 <= e < layout.num_experts:
            continue
        pos, tok = torch.where(top_k_index.T == e)  # (n,), (n,) position-major, the eager forward's row order
        y = expert_apply(mod, hidden[tok], weights_of(e))  # (n, H)
        if layout.compute_fp32:
            y = y * top_k_weights[tok, pos, None].float()  # (n, H)
        else:
            y = y * top_k_weights[tok, pos, None]  # (n, H)
        out.index_add_(0, tok, y.to(out.dtype))
    return out.to(hidden.dtype)


def expert_refusal(mod: nn.Module, family: str) -> str | None:
    """Why fate_lab cannot serve this experts module (family, layout, what to do), or None if it can."""
    if not is_experts_module(mod):
        return (f"{family}: {type(mod).__name__} is not a transformers experts-interface module "
                "(@use_experts_implementation); fate_lab serves only those")
    name = type(mod).__name__
    if getattr(mod, "_is_expert_parallel", False):
        return f"{family}: {name} is expert-parallel (sharded over devices); load the model on one device"
    layout_params = ({n for n, _ in mod.named_parameters(recurse=False)}
                     | {n for n, _ in mod.named_buffers(recurse=False)})
    need = {"gate_up_proj" if mod.has_gate else "up_proj", "down_proj"}
    if mod.has_bias:
        need |= {f"{n}_bias" for n in need}
    if need - layout_params:
        return (f"{family}: {name} lacks {sorted(need - layout_params)} for its declared layout "
                f"(has_gate={mod.has_gate}, has_bias={mod.has_bias}); tensors present: {sorted(layout_params)}. "
                "The experts were replaced (e.g. by a quantization integration); load the checkpoint dequantized")
    unknown = sorted(layout_params - set(_WEIGHT_NAMES))
    if unknown:
        return (f"{family}: {name} holds tensors fate_lab does not know how to move or compute with: {unknown} "
                f"(known: {list(_WEIGHT_NAMES)}); they are probably quantization scales, and fate_lab has no "
                "dequantizer for them: load the checkpoint in a float dtype")
    bad = {n: str(getattr(mod, n).dtype) for n in need if not getattr(mod, n).dtype.is_floating_point}
    if bad:
        return (f"{family}: {name} stores experts as {bad}, a quantized format fate_lab cannot dequantize; "
                "load the checkpoint dequantized to bfloat16/float16/float32")
    used = eager_facts(type(mod))[2]  # a subclass's own forward around the dispatched call runs as model code
    children = {n for n, _ in mod.named_children() if used is None or n in used} - {"act_fn"}
    if mod.has_post_expert_norm:
        children -= {"post_expert_norm"}
    if children:
        return (f"{family}: {name} has submodules fate_lab does not compute: {sorted(children)}; only act_fn "
                "and post_expert_norm are part of the expert math it implements")
    if all(getattr(mod, n).dim() >= 2 and not getattr(mod, n).is_meta for n in need):  # meta: `load_offloaded`
        return math_refusal(mod, family)  # probes with experts read from the files
    return None


class _Dispatch:
    """A module's config with an experts implementation of its own (the model's config is left as it is)."""

    def __init__(self, config, implementation: str):
        self._config, self._experts_implementation = config, implementation

    def __getattr__(self, name: str):
        return getattr(self._config, name)


@functools.cache
def reference_implementation() -> str:
    """The name under which `combine_experts` is registered in transformers' ExpertsInterface (registered once):
    a module dispatched to it computes its experts with fate_lab's math, everything around them as its own."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register("fate_reference", lambda self, hidden, idx, w: combine_experts(self, hidden, idx, w))
    return "fate_reference"


def _stand_in(mod: nn.Module, experts: list[ExpertWeights] | None) -> nn.Module:
    """A copy of mod that can be dispatched on its own on the CPU: with `experts`, its expert tensors hold only
    those (ids 0..n-1) in the module's own layout and its submodules are CPU copies; without, it shares mod's own
    (CPU) tensors and submodules. Its other attributes are mod's."""
    probe = copy.copy(mod)
    probe._parameters = dict(mod._parameters)
    if experts is None:
        return probe
    probe._modules = {n: copy.deepcopy(c).to("cpu") for n, c in mod._modules.items()}  # act_fn, norms: small
    layout = layout_of(mod)
    stacked = {name: torch.stack([getattr(w, field).to("cpu") for w in experts])
               for field, name in layout.tensor_names().items()}
    for name in (layout.up_name, "down_proj") if layout.is_transposed else ():
        stacked[name] = stacked[name].transpose(1, 2)  # (n, H, R), (n, I, H): the canonical tensors transposed back
    for name, t in stacked.items():
        probe._parameters[name] = nn.Parameter(t, requires_grad=False)
    return probe


def _probe_differs(probe: nn.Module, hidden: torch.Tensor, k: int, dtype: torch.dtype) -> str | None:
    """What differs between the module's forward dispatched to transformers' eager kernel and to fate_lab's math,
    on hidden [T, H] routed to experts 0 and 1 (k per token) with routing weights in dtype; None when bit for bit
    equal."""
    T, device = hidden.shape[0], hidden.device
    g = torch.Generator().manual_seed(k)
    idx = torch.tensor([[(t + j) % 2 for j in range(k)] for t in range(T)], device=device)  # (T, k)
    w = (torch.rand(T, k, generator=g) * 0.9 + 0.1).to(device, dtype)  # (T, k)
    out = {}
    for implementation in ("eager", reference_implementation()):
        probe.config = _Dispatch(probe.config, implementation)
        try:
            with torch.no_grad():
                out[implementation] = type(probe).forward(probe, hidden, idx, w)  # (T, H)
        finally:
            probe.config = probe.config._config
    ref, ours = out.values()
    if ref.shape == ours.shape and ref.dtype == ours.dtype and torch.equal(ref, ours):
        return None
    if ref.shape != ours.shape or ref.dtype != ours.dtype:
        return f"its output is {tuple(ref.shape)} {ref.dtype}, fate_lab's {tuple(ours.shape)} {ours.dtype}"
    return f"max |difference| {float((ref.float() - ours.float()).abs().max()):.3g} (k={k}, weights in {dtype})"


# {(experts class, dtype, its eager facts): math_refusal's verdict}: the installed release computes a class the same
# way for every layer and every call of a process, so each class is probed once
_VERDICTS: dict[tuple, str | None] = {}


def math_refusal(mod: nn.Module, family: str, experts: list[ExpertWeights] | None = None) -> str | None:
    """Why the module's forward, with its experts computed by fate_lab's math (as the runtime computes them), is
    not what it is with transformers' eager kernel, in the installed release -- compared bit for bit on the CPU, on
    PROBE_TOKENS random tokens routed to experts 0 and 1, with float32 and the module's dtype routing weights --
    or None. This checks what the release computes (its semantics), not a device's rounding: a module on an
    accelerator is probed with CPU copies of its first two experts. Each experts class is probed once per process.

    experts: the first experts' weights when mod holds none (meta tensors: `load_offloaded` reads them from the
    files); by default mod's own."""
    import transformers

    layout = layout_of(mod)
    key = (type(mod), layout.dtype, eager_facts(type(mod)))
    if key in _VERDICTS:
        return _VERDICTS[key]
    n = min(2, layout.num_experts)
    own = read_expert(mod, 0).gate_up
    if experts is None and own.is_meta:
        raise ValueError(f"{layout.experts_class} holds no expert weights (meta tensors): pass experts=[the first "
                         "two experts' ExpertWeights], e.g. read from its checkpoint (ExpertIndex.read)")
    if experts is None and own.device.type != "cpu":
        experts = [read_expert(mod, e) for e in range(n)]
    probe = _stand_in(mod, None if experts is None else experts[:n])
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(PROBE_TOKENS, layout.hidden_size, generator=g).to(layout.dtype)  # (T, H)
    weight_dtypes = dict.fromkeys((torch.float32, layout.dtype))  # routers hand the experts either
    try:
        diff = next((d for d in (_probe_differs(probe, hidden, n, t) for t in weight_dtypes) if d), None)
    except (RuntimeError, IndexError, ValueError, TypeError) as err:
        diff = f"its forward fails on the probe: {type(err).__name__}: {str(err)[:160]}"
    _VERDICTS[key] = None if diff is None else (
        f"{family}: {layout.experts_class} computes other numbers with fate_lab's expert math than with the eager "
        f"kernel of the installed transformers {transformers.__version__}, on a probe of {PROBE_TOKENS} tokens "
        f"({diff}): this release changed how the family computes its experts, and fate_lab refuses rather than give "
        "other outputs; install the transformers version in fate_lab's constraints.txt, or a fate_lab release that "
        "supports this one")
    return _VERDICTS[key]


def check_servable(mod: nn.Module, family: str) -> ExpertLayout:
    """The layout of a module fate_lab can serve; NotImplementedError with `expert_refusal`'s reason if not."""
    reason = expert_refusal(mod, family)
    if reason is not None:
        raise NotImplementedError(reason)
    return layout_of(mod)
