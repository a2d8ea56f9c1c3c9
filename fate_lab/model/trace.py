"""Routing traces: record once from a real model, replay policies on them many times.

What it is: the ``Trace`` type (per token and MoE layer: gate input, router logits, selected
experts and their weights, plus phase and prompt boundaries), ``record_trace`` that fills it
from a real prefill + greedy decode, a documented on-disk format, and the conversion of a plain
routing array from another tool. What it is not: an analysis or a cache simulator (see
``analysis``, ``predictors``, ``replay``).

On-disk format (one ``.safetensors`` file, no pickles):
  tensors  ``experts`` int [N, L, k] (int64 from ``record_trace``; a routing array's int8/int16/
           int32/uint8 ids keep their width); optional ``weights`` f32 [N, L, k], ``logits`` [N, L, E],
           ``gate_inputs`` [N, L, H] (f16 by default), ``router_weights`` f32 [L, E, H], ``router_biases``
           f32 [L, E] (routers with a logit bias, e.g. gpt-oss);
           ``token_ids``, ``phase`` (0 prefill, 1 decode), ``prompt_id``, ``position`` int64 [N].
  metadata ``{"fate_lab_trace": <JSON of Trace.meta>}`` (family, num_experts, top_k, moe_layers,
           router scoring, prompts, generated texts, format version).
Rows are in processing order: prompt 0's prefill tokens, its decode tokens, then prompt 1, ...
"""
from __future__ import annotations

import json
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

PREFILL, DECODE = 0, 1
PHASES = {"prefill": PREFILL, "decode": DECODE}
FORMAT_VERSION = 1
_OPTIONAL = ("weights", "logits", "gate_inputs", "router_weights", "router_biases")
_REQUIRED = ("experts", "token_ids", "phase", "prompt_id", "position")
_ID_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)  # expert ids kept at their width
_PAIRWISE_MAX_K = 16  # duplicate check: k(k-1)/2 compares per row up to this k (compiled, one pass), a sort beyond


def _first_true(mask: torch.Tensor) -> tuple[int, ...]:
    """Index of the first true entry of a bool tensor in row-major order (the caller knows one exists)."""
    flat = int(mask.reshape(-1).to(torch.uint8).argmax())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape))


def _check_phase_values(phase: torch.Tensor, what: str) -> None:
    """ValueError naming `what`, the first bad value and its row unless every phase is PREFILL or DECODE."""
    bad = (phase != PREFILL) & (phase != DECODE)  # (N,)
    if bool(bad.any()):
        row = _first_true(bad)[0]
        raise ValueError(f"{what} must hold {PREFILL} (prefill) or {DECODE} (decode); got {phase[row].item()} "
                         f"at row {row} ({int(bad.sum())} bad rows in all)")


@dataclass(eq=False)  # identity: a trace is one recording (caches key on it)
class Trace:
    """Routing of N tokens through L MoE layers (k experts each), with optional gate data."""

    experts: torch.Tensor  # (N, L, k) int64 expert ids
    token_ids: torch.Tensor  # (N,) int64 input token at each row
    phase: torch.Tensor  # (N,) int64, PREFILL or DECODE
    prompt_id: torch.Tensor  # (N,) int64
    position: torch.Tensor  # (N,) int64 position in its sequence
    meta: dict = field(default_factory=dict)
    weights: torch.Tensor | None = None  # (N, L, k) routing weights as applied by the model
    logits: torch.Tensor | None = None  # (N, L, E) router logits
    gate_inputs: torch.Tensor | None = None  # (N, L, H) what each router multiplied
    router_weights: torch.Tensor | None = None  # (L, E, H) each MoE layer's router weight
    router_biases: torch.Tensor | None = None  # (L, E) each router's logit bias (None: no router has one)

    def __post_init__(self) -> None:
        if self.experts.dim() != 3:
            raise ValueError(f"Trace.experts must be [tokens, layers, k]; got shape {tuple(self.experts.shape)}")
        if self.experts.is_floating_point() or self.experts.is_complex() or self.experts.dtype == torch.bool:
            raise TypeError(f"Trace.experts must hold integer expert ids, got dtype {self.experts.dtype}")
        N, L, k = self.experts.shape
        for name in ("token_ids", "phase", "prompt_id", "position"):
            if getattr(self, name).shape != (N,):
                raise ValueError(f"Trace.{name} must have shape ({N},), got {tuple(getattr(self, name).shape)}")
        for name, trailing in (("weights", (k,)), ("logits", None), ("gate_inputs", None)):
            t = getattr(self, name)
            if t is not None and (t.shape[:2] != (N, L) or (trailing and t.shape[2:] != trailing)):
                raise ValueError(f"Trace.{name} has shape {tuple(t.shape)}, expected ({N}, {L}, ...)")
        if self.experts.numel() and (self.experts.min() < 0 or self.experts.max() >= self.num_experts):
            raise ValueError(f"expert ids must lie in [0, {self.num_experts}); "
                             f"got {self.experts.min()}..{self.experts.max()}")
        if self.router_weights is not None:
            rw = self.router_weights
            H = None if self.gate_inputs is None else self.gate_inputs.shape[-1]
            if rw.dim() != 3 or rw.shape[0] != L or rw.shape[1] < (int(self.experts.max()) + 1 if self.experts.numel()
                                                                   else 0) or (H is not None and rw.shape[2] != H):
                raise ValueError(f"Trace.router_weights must be [layers={L}, experts, hidden"
                                 f"{'' if H is None else '=' + str(H)}] (one router weight per MoE layer, wide enough "
                                 f"for every routed id); got shape {tuple(rw.shape)}")
        if self.phase.is_floating_point() or self.phase.is_complex():
            raise TypeError(f"Trace.phase must hold integers {PREFILL} (prefill) or {DECODE} (decode), "
                            f"got dtype {self.phase.dtype}")
        _check_phase_values(self.phase, "Trace.phase")

    @property
    def num_tokens(self) -> int:
        """N, the number of rows (tokens)."""
        return self.experts.shape[0]

    @property
    def num_layers(self) -> int:
        """L, the number of MoE layers."""
        return self.experts.shape[1]

    @property
    def top_k(self) -> int:
        """k, experts per token and layer."""
        return self.experts.shape[2]

    @property
    def num_experts(self) -> int:
        """E, routed experts per layer (from meta, else the logits, else the largest id + 1)."""
        if "num_experts" in self.meta:
            return int(self.meta["num_experts"])
        if self.logits is not None:
            return self.logits.shape[-1]
        return int(self.experts.max()) + 1 if self.experts.numel() else 0

    def subset(self, mask: torch.Tensor) -> "Trace":
        """The rows where ``mask`` (bool [N]) is true, in order."""
        rows = {n: getattr(self, n)[mask] for n in ("experts", "token_ids", "phase", "prompt_id", "position")}
        opt = {n: (getattr(self, n)[mask] if getattr(self, n) is not None else None)
               for n in ("weights", "logits", "gate_inputs")}
        return replace(self, **rows, **opt)

    def decode(self) -> "Trace":
        """Only the decode-phase rows."""
        return self.subset(self.phase == DECODE)

    def prefill(self) -> "Trace":
        """Only the prefill-phase rows."""
        return self.subset(self.phase == PREFILL)

    def summary(self) -> dict:
        """A few plain numbers describing the trace."""
        return {
            "tokens": self.num_tokens, "prefill_tokens": int((self.phase == PREFILL).sum()),
            "decode_tokens": int((self.phase == DECODE).sum()), "prompts": int(self.prompt_id.unique().numel()),
            "moe_layers": self.num_layers, "experts": self.num_experts, "top_k": self.top_k,
            "has_gate_inputs": self.gate_inputs is not None, "has_logits": self.logits is not None,
        }

    def save(self, path: str | Path, gate_dtype: torch.dtype = torch.float16) -> Path:
        """Write the trace as one safetensors file (format in the module docstring)."""
        from safetensors.torch import save_file

        tensors = {n: getattr(self, n).to(torch.int64).contiguous() for n in _REQUIRED}
        if self.experts.dtype in _ID_DTYPES:  # narrow ids (e.g. int8 from a routing array) keep their width
            tensors["experts"] = self.experts.contiguous()
        for n in _OPTIONAL:
            t = getattr(self, n)
            if t is not None:
                dtype = gate_dtype if n == "gate_inputs" else torch.float32
                tensors[n] = t.to(dtype).contiguous()
        meta = dict(self.meta, format_version=FORMAT_VERSION, num_experts=self.num_experts)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"fate_lab_trace": json.dumps(meta)})
        return path

    @staticmethod
    def load(path: str | Path) -> "Trace":
        """Read a trace written by ``save`` (safetensors + JSON metadata; no pickles)."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder; give the trace's .safetensors file (Trace.save writes one)")
        if not path.is_file():
            raise FileNotFoundError(f"no trace file at {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                raw = (f.metadata() or {}).get("fate_lab_trace")
                if raw is None:
                    raise ValueError(f"{path} is a safetensors file but not a fate_lab trace (no 'fate_lab_trace' "
                                     "metadata)")
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as exc:
            raise ValueError(f"{path} is not a readable safetensors file ({exc}): truncated or corrupt? Save the "
                             "trace again (Trace.save)") from None
        try:
            meta = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: its 'fate_lab_trace' metadata is not valid JSON ({e}); expected a JSON "
                             f"object such as {{\"format_version\": {FORMAT_VERSION}, \"num_experts\": 8, ...}}, "
                             f"got {raw[:80]!r}") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{path}: its 'fate_lab_trace' metadata must be a JSON object "
                             f"({{\"format_version\": ..., ...}}), got a JSON {type(meta).__name__}: {raw[:80]!r}")
        version = meta.get("format_version", 0)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"{path}: metadata format_version must be a non-negative integer "
                             f"(this fate_lab reads up to {FORMAT_VERSION}), got {version!r}")
        if version > FORMAT_VERSION:
            raise ValueError(f"{path} has trace format {version}; this fate_lab reads up to {FORMAT_VERSION}")
        num_experts = meta.get("num_experts")
        if num_experts is not None and (isinstance(num_experts, bool) or not isinstance(num_experts, int)
                                        or num_experts < 1):
            raise ValueError(f"{path}: metadata num_experts must be a positive integer, got {num_experts!r}")
        missing = [n for n in _REQUIRED if n not in tensors]
        if missing:
            raise ValueError(f"{path} is not a complete fate_lab trace: tensors {missing} are missing "
                             f"(a trace holds {list(_REQUIRED)}, optionally {list(_OPTIONAL)})")
        shape = tuple(tensors["experts"].shape)
        if len(shape) == 3 and 0 in shape:
            raise ValueError(f"{path} holds an empty trace: its experts tensor has shape {shape} [tokens, layers, k]; "
                             "a trace needs at least one token, one MoE layer and k >= 1. Record or save it again")
        opt = {n: (tensors[n].float() if n in tensors else None) for n in _OPTIONAL}
        return Trace(experts=tensors["experts"], token_ids=tensors["token_ids"], phase=tensors["phase"],
                     prompt_id=tensors["prompt_id"], position=tensors["position"], meta=meta, **opt)


def _int_vector(value, name: str, n: int | None, allowed: str) -> torch.Tensor:
    """value as a 1-D integer tensor (of length n if given); TypeError/ValueError naming `name` otherwise."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{name} must be {allowed}; could not read {value!r:.80} as an array ({e})") from None
    if t.numel() == 0 and t.is_floating_point():  # torch reads an empty list as float32
        t = t.to(torch.int64)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be {allowed}; got dtype {t.dtype}")
    if t.dim() != 1 or (n is not None and t.shape[0] != n):
        want = f"({n},)" if n is not None else "1-D"
        raise ValueError(f"{name} must have shape {want} ({allowed}); got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def _phase_vector(phase, n: int) -> torch.Tensor:
    """phase -> int64 [n]: None (all decode), "prefill"/"decode", 0/1, or a length-n sequence of either."""
    allowed = f"None, 'prefill', 'decode', {PREFILL}, {DECODE}, or a sequence of {n} of those"
    if phase is None:
        return torch.full((n,), DECODE, dtype=torch.int64)
    if getattr(getattr(phase, "dtype", None), "kind", None) in ("U", "S", "O"):  # numpy array of names
        phase = phase.tolist()
    if isinstance(phase, str) or (isinstance(phase, (list, tuple)) and phase and isinstance(phase[0], str)):
        names = [phase] if isinstance(phase, str) else list(phase)
        bad = [(i, p) for i, p in enumerate(names) if not isinstance(p, str) or p.lower() not in PHASES]
        if bad:
            where = f" at row {bad[0][0]}" if len(names) > 1 else ""
            raise ValueError(f"phase must be {allowed}; got {bad[0][1]!r}{where}")
        codes = torch.tensor([PHASES[p.lower()] for p in names], dtype=torch.int64)
        return codes.expand(n).clone() if isinstance(phase, str) else _int_vector(codes, "phase", n, allowed)
    if isinstance(phase, numbers.Integral) and not isinstance(phase, bool):
        out = torch.full((n,), int(phase), dtype=torch.int64)
    else:
        out = _int_vector(phase, "phase", n, allowed)
    _check_phase_values(out, "phase")
    return out


def _positions(prompt_id: torch.Tensor) -> torch.Tensor:
    """Position of each row within its prompt (rows of a prompt counted in order), vectorised."""
    n = prompt_id.numel()
    grouped = n < 2 or bool((prompt_id[1:] >= prompt_id[:-1]).all())  # rows already grouped: no sort (a bare array)
    order = None if grouped else torch.sort(prompt_id, stable=True).indices  # (N,) rows grouped, in row order
    sorted_pid = prompt_id if grouped else prompt_id[order]  # (N,)
    new_group = torch.ones(n, dtype=torch.bool)
    new_group[1:] = sorted_pid[1:] != sorted_pid[:-1]  # (N,) first row of each prompt
    idx = torch.arange(n)  # (N,)
    group_start = torch.cummax(torch.where(new_group, idx, torch.zeros_like(idx)), dim=0).values  # (N,)
    if grouped:
        return idx - group_start
    position = torch.empty(n, dtype=torch.int64)
    position[order] = idx - group_start
    return position


def _duplicate_scan(experts: torch.Tensor) -> tuple[int, int, int]:
    """(rows of experts [N, L, k] naming one expert twice, the first one's token, its layer); (0, -1, -1) if
    none. Up to k = 16, one compiled pass of pairwise compares in registers (a routing array is read once, not
    copied: the public replay's check of a bare array); beyond, a sort."""
    k = experts.shape[-1]
    if k > _PAIRWISE_MAX_K:
        s = torch.sort(experts, dim=-1).values  # (N, L, k)
        dup = (s[..., 1:] == s[..., :-1]).any(dim=-1)  # (N, L)
        if not bool(dup.any()):
            return 0, -1, -1
        n, l = _first_true(dup)
        return int(dup.sum()), n, l
    from fate_lab.model.routing_scan import duplicate_rows

    count, n, l = duplicate_rows(experts.detach().cpu().contiguous().numpy())
    return int(count), int(n), int(l)


def from_routing_array(routing, num_experts: int | None = None, phase=None, prompt_id=None,
                       meta: dict | None = None, lengths=None) -> Trace:
    """A Trace from a plain ``[tokens, layers, k]`` array of expert ids (e.g. vLLM routed experts).

    ``routing``: integer ids (torch/numpy/nested lists), kept at their dtype (int8/int16/int32/int64/
    uint8; uint16/uint32/uint64 become int32/int64/int64, which torch can compare). ``num_experts``:
    E; if omitted (and not in ``meta``), inferred as the largest id + 1 with a warning, since experts
    never routed to would be missed. ``phase``: None (all decode), "prefill"/"decode", 0/1, or one per
    token. Prompts: ``lengths`` (tokens per prompt, in order, summing to N) or ``prompt_id`` [N]
    (positions restart at each prompt, counted in row order); neither means one prompt. Each row
    must name k distinct ids in [0, E).
    """
    try:
        experts = torch.as_tensor(routing)
    except (TypeError, ValueError, RuntimeError) as e:  # ragged lists: ValueError; non-numbers: TypeError
        raise (ValueError if isinstance(e, ValueError) else TypeError)(
            f"routing must be a rectangular [tokens, layers, k] array of integer expert ids; "
            f"could not convert it ({e})") from None
    if experts.is_floating_point() or experts.is_complex() or experts.dtype == torch.bool:
        raise TypeError(f"routing must hold integer expert ids, got dtype {experts.dtype}; convert whole-number "
                        f"floats explicitly (e.g. arr.astype('int32')) after checking them")
    if experts.dtype not in _ID_DTYPES:  # uint16/32/64: torch lacks min/max for them
        experts = experts.to(torch.int32 if experts.dtype == torch.uint16 else torch.int64)
    if experts.dim() != 3:
        raise ValueError(f"a routing array must be [tokens, layers, k]; got shape {tuple(experts.shape)}")
    N, L, k = experts.shape
    if N == 0:
        raise ValueError("routing has 0 tokens: a trace needs at least one token's routing")
    if L == 0 or k == 0:
        raise ValueError(f"routing has shape {tuple(experts.shape)}: "
                         f"{'0 layers' if L == 0 else 'k=0 experts per token'}; a routing array is "
                         "[tokens, layers >= 1, k >= 1] (each token's k expert ids in every MoE "
                         "layer)")
    if meta is not None and not isinstance(meta, Mapping):
        raise TypeError(f"meta must be a dict (JSON-serialisable), got {type(meta).__name__}")
    meta = dict(meta or {}, source=(meta or {}).get("source", "routing array"))

    # number of experts: given, from meta, or inferred (with a warning)
    if num_experts is not None:
        if isinstance(num_experts, bool) or not isinstance(num_experts, numbers.Integral):
            raise TypeError(f"num_experts must be a positive int, got {num_experts!r} ({type(num_experts).__name__})")
        if num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts}")
        if "num_experts" in meta and int(meta["num_experts"]) != int(num_experts):
            raise ValueError(f"num_experts={num_experts} disagrees with meta['num_experts']={meta['num_experts']}")
        meta["num_experts"] = int(num_experts)
    elif "num_experts" in meta:
        num_experts = int(meta["num_experts"])
    elif experts.numel():
        num_experts = int(experts.max()) + 1
        warnings.warn(f"num_experts not given: inferred as the largest expert id + 1 = {num_experts}, which is too "
                      f"small if the highest-numbered experts were never routed to; pass num_experts=E",
                      UserWarning, stacklevel=2)
    if num_experts is not None:
        if k > num_experts:
            raise ValueError(f"routing has k={k} experts per token and layer but num_experts={num_experts}; "
                             f"k must be <= num_experts")
        if experts.numel():
            lo, hi = torch.aminmax(experts)
            if int(lo) < 0 or int(hi) >= num_experts:
                n, l, j = _first_true((experts < 0) | (experts >= num_experts))
                raise ValueError(f"expert ids must lie in [0, num_experts={num_experts}); got {int(experts[n, l, j])} "
                                 f"at token {n}, layer {l} (row {experts[n, l].tolist()})")
    if N and k > 1:
        count, n, l = _duplicate_scan(experts)
        if count:
            raise ValueError(f"routing repeats an expert id within one (token, layer) row: token {n}, layer {l} "
                             f"routes to {experts[n, l].tolist()}; each row must name k={k} distinct experts "
                             f"({count} such rows in all)")

    phase = _phase_vector(phase, N)
    if lengths is not None and prompt_id is not None:
        raise ValueError("give either lengths (tokens per prompt) or prompt_id (one per token), not both")
    if lengths is not None:
        lengths = _int_vector(lengths, "lengths", None, "a 1-D sequence of non-negative tokens-per-prompt counts")
        if lengths.numel() and int(lengths.min()) < 0:
            p = _first_true(lengths < 0)[0]
            raise ValueError(f"lengths must be non-negative tokens-per-prompt counts; "
                             f"got {int(lengths[p])} for prompt {p}")
        if int(lengths.sum()) != N:
            raise ValueError(f"lengths must sum to the routing array's {N} tokens; got sum {int(lengths.sum())} "
                             f"over {lengths.numel()} prompts")
        prompt_id = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)  # (N,)
        starts = torch.cumsum(lengths, 0) - lengths  # (P,) first row of each prompt
        position = torch.arange(N) - torch.repeat_interleave(starts, lengths)  # (N,)
    else:
        prompt_id = (torch.zeros(N, dtype=torch.int64) if prompt_id is None
                     else _int_vector(prompt_id, "prompt_id", N, "one integer prompt id per token"))
        position = _positions(prompt_id)  # (N,) restarts at each prompt
    return Trace(experts=experts, token_ids=torch.full((N,), -1, dtype=torch.int64), phase=phase,
                 prompt_id=prompt_id, position=position, meta=meta)


def _check_reproducible(trace: Trace) -> None:
    """ValueError unless the trace's router weights reproduce its routers' scores (linear softmax/sigmoid)."""
    if trace.meta.get("router_linear") is False or trace.meta.get("scoring", "softmax") not in ("softmax", "sigmoid"):
        raise ValueError(f"the {trace.meta.get('family')!r} router is not its gate input times a weight matrix "
                         f"scored by softmax or sigmoid (scoring {trace.meta.get('scoring')!r}; e.g. it normalises "
                         "its input or is an MLP), so this trace's router weights cannot reproduce it: predict with "
                         "the model's own routers, adapters.MoEAdapter.host_routers() (pass it as simulate(..., "
                         "router=...)), or MoEAdapter.probs(l + 1, gate input of layer l)")
    if trace.gate_inputs is None or trace.router_weights is None:
        raise ValueError("this trace has no gate inputs/router weights (e.g. it came from a routing array); "
                         "record one with record_trace to use cross-layer prediction")


def router_scores(trace: Trace):
    """Every MoE layer's router as the trace's weights (and logit biases) reproduce it: a `policy.rules.RouterScores`.
    ValueError for a trace without them, or of a router they cannot reproduce (see `_check_reproducible`)."""
    from fate_lab.policy.rules import RouterScores

    _check_reproducible(trace)
    biases = None if trace.router_biases is None else list(trace.router_biases)
    return RouterScores([w.float() for w in trace.router_weights], trace.meta.get("scoring", "softmax"), biases)


def cross_layer_scores(trace: Trace) -> torch.Tensor:
    """Scores for layer l+1 predicted from layer l's gate input: [N, L-1, E] (Fate's prefetch signal)."""
    from fate_lab.policy.rules import cross_layer_scores as _scores

    _check_reproducible(trace)
    return _scores(trace.gate_inputs, list(trace.router_weights), trace.meta.get("scoring", "softmax"),
                   None if trace.router_biases is None else list(trace.router_biases))
