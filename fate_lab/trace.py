"""Routing traces: record once from a real model, replay policies on them many times.

What it is: the ``Trace`` type (per token and MoE layer: gate input, router logits, selected
experts and their weights, plus phase and prompt boundaries), ``record_trace`` that fills it
from a real prefill + greedy decode, a documented on-disk format, and the conversion of a plain
routing array from another tool. What it is not: an analysis or a cache simulator (see
``analysis``, ``predictors``, ``replay``).

On-disk format (one ``.safetensors`` file, no pickles):
  tensors  ``experts`` int64 [N, L, k]; optional ``weights`` f32 [N, L, k], ``logits`` [N, L, E],
           ``gate_inputs`` [N, L, H] (f16 by default), ``router_weights`` f32 [L, E, H];
           ``token_ids``, ``phase`` (0 prefill, 1 decode), ``prompt_id``, ``position`` int64 [N].
  metadata ``{"fate_lab_trace": <JSON of Trace.meta>}`` (family, num_experts, top_k, moe_layers,
           router scoring, prompts, generated texts, format version).
Rows are in processing order: prompt 0's prefill tokens, its decode tokens, then prompt 1, ...
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

PREFILL, DECODE = 0, 1
FORMAT_VERSION = 1
_OPTIONAL = ("weights", "logits", "gate_inputs", "router_weights")


@dataclass
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

    def __post_init__(self) -> None:
        N, L, k = self.experts.shape
        for name in ("token_ids", "phase", "prompt_id", "position"):
            if getattr(self, name).shape != (N,):
                raise ValueError(f"Trace.{name} must have shape ({N},), got {tuple(getattr(self, name).shape)}")
        for name, trailing in (("weights", (k,)), ("logits", None), ("gate_inputs", None)):
            t = getattr(self, name)
            if t is not None and (t.shape[:2] != (N, L) or (trailing and t.shape[2:] != trailing)):
                raise ValueError(f"Trace.{name} has shape {tuple(t.shape)}, expected ({N}, {L}, ...)")
        if self.experts.numel() and (self.experts.min() < 0 or self.experts.max() >= self.num_experts):
            raise ValueError(f"expert ids must lie in [0, {self.num_experts}); got {self.experts.min()}..{self.experts.max()}")

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

        tensors = {n: getattr(self, n).to(torch.int64).contiguous()
                   for n in ("experts", "token_ids", "phase", "prompt_id", "position")}
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
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("fate_lab_trace")
            if raw is None:
                raise ValueError(f"{path} is a safetensors file but not a fate_lab trace (no 'fate_lab_trace' metadata)")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(raw)
        if meta.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(f"{path} has trace format {meta['format_version']}; this fate_lab reads up to {FORMAT_VERSION}")
        opt = {n: (tensors[n].float() if n in tensors else None) for n in _OPTIONAL}
        return Trace(experts=tensors["experts"], token_ids=tensors["token_ids"], phase=tensors["phase"],
                     prompt_id=tensors["prompt_id"], position=tensors["position"], meta=meta, **opt)


def from_routing_array(routing, num_experts: int | None = None, phase=None, prompt_id=None,
                       meta: dict | None = None) -> Trace:
    """A Trace from a plain ``[tokens, layers, k]`` array of expert ids (e.g. vLLM routed experts)."""
    experts = torch.as_tensor(routing).to(torch.int64)
    if experts.dim() != 3:
        raise ValueError(f"a routing array must be [tokens, layers, k]; got shape {tuple(experts.shape)}")
    N = experts.shape[0]
    meta = dict(meta or {}, source=(meta or {}).get("source", "routing array"))
    if num_experts is not None:
        meta["num_experts"] = int(num_experts)
    phase = torch.full((N,), DECODE, dtype=torch.int64) if phase is None else torch.as_tensor(phase).to(torch.int64)
    prompt_id = torch.zeros(N, dtype=torch.int64) if prompt_id is None else torch.as_tensor(prompt_id).to(torch.int64)
    position = torch.zeros(N, dtype=torch.int64)
    for p in prompt_id.unique():  # position restarts at each prompt
        rows = (prompt_id == p).nonzero().flatten()
        position[rows] = torch.arange(rows.numel())
    return Trace(experts=experts, token_ids=torch.full((N,), -1, dtype=torch.int64), phase=phase,
                 prompt_id=prompt_id, position=position, meta=meta)


class _Recorder:
    """Forward hooks that capture, per MoE layer, the gate input, logits and applied routing."""

    def __init__(self, adapter) -> None:
        self.adapter = adapter
        self.handles = []
        self.calls: dict[str, list] = {}
        for m in range(adapter.num_moe_layers):
            block = adapter.block(m)
            router = getattr(block, "gate")
            self.handles.append(router.register_forward_hook(self._router_hook(m)))
            self.handles.append(adapter.experts_module(m).register_forward_pre_hook(self._experts_hook(m)))
        self.reset()

    def reset(self) -> None:
        L = self.adapter.num_moe_layers
        self.calls = {"gate_inputs": [None] * L, "logits": [None] * L, "experts": [None] * L, "weights": [None] * L}

    def _router_hook(self, m):
        def hook(module, args, out):
            x = args[0]
            self.calls["gate_inputs"][m] = x.detach().reshape(-1, x.shape[-1]).float().cpu()  # (T, H)
            logits = out[0] if isinstance(out, tuple) else out
            self.calls["logits"][m] = logits.detach().reshape(-1, logits.shape[-1]).float().cpu()  # (T, E)
        return hook

    def _experts_hook(self, m):
        def hook(module, args):
            _, idx, w = args[:3]
            self.calls["experts"][m] = idx.detach().reshape(idx.shape[0], -1).cpu()  # (T, k)
            self.calls["weights"][m] = w.detach().reshape(w.shape[0], -1).float().cpu()  # (T, k)
        return hook

    def take(self) -> dict[str, torch.Tensor]:
        """Stack this forward's captures into [T, L, ...] tensors and reset."""
        missing = [m for m, t in enumerate(self.calls["experts"]) if t is None]
        if missing:
            raise RuntimeError(f"MoE layers {missing} were not called in this forward; cannot record them")
        out = {k: torch.stack(v, dim=1) for k, v in self.calls.items()}
        self.reset()
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def record_trace(model, tokenizer, prompts: list, decode_tokens: int = 32, max_prompt_tokens: int | None = None,
                 progress: bool = True) -> Trace:
    """Prefill each prompt, then greedy-decode ``decode_tokens`` steps, recording every MoE layer."""
    from fate_lab.adapters import adapt

    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of strings or token-id lists, not a single string")
    if decode_tokens < 0:
        raise ValueError(f"decode_tokens must be >= 0, got {decode_tokens}")
    adapter = adapt(model)
    device = next(model.parameters()).device
    rec = _Recorder(adapter)
    rows: dict[str, list] = {k: [] for k in ("experts", "weights", "logits", "gate_inputs")}
    token_ids, phase, prompt_id, position, generated = [], [], [], [], []
    bar = tqdm(total=len(prompts) * (1 + decode_tokens), desc="record trace", unit="fwd", disable=not progress)
    try:
        for p, prompt in enumerate(prompts):
            if isinstance(prompt, str) and tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass one or give token-id lists")
            ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else [int(t) for t in prompt]
            if max_prompt_tokens is not None:
                ids = ids[:max_prompt_tokens]
            if not ids:
                raise ValueError(f"prompt {p} is empty after tokenisation")
            x = torch.tensor([ids], device=device)  # (1, T)
            out = model(input_ids=x, use_cache=True)
            cap = rec.take()
            for k in rows:
                rows[k].append(cap[k])
            token_ids += ids
            phase += [PREFILL] * len(ids)
            prompt_id += [p] * len(ids)
            position += list(range(len(ids)))
            bar.update(1)
            cache = out.cache
            nxt = int(out.logits[0, -1].argmax())
            new = [nxt]
            for step in range(decode_tokens):
                pos = len(ids) + step
                out = model(input_ids=torch.tensor([[nxt]], device=device), cache=cache, use_cache=True)
                cap = rec.take()
                for k in rows:
                    rows[k].append(cap[k])
                token_ids.append(nxt)
                phase.append(DECODE)
                prompt_id.append(p)
                position.append(pos)
                cache = out.cache
                nxt = int(out.logits[0, -1].argmax())
                new.append(nxt)
                bar.update(1)
            generated.append(tokenizer.decode(new) if tokenizer is not None else new)
    finally:
        rec.close()
        bar.close()
    router_weights = torch.stack([adapter.router_weight(m).detach().float().cpu() for m in range(adapter.num_moe_layers)])
    meta = {
        "source": "record_trace", "family": adapter.family, "model": str(getattr(model.config, "_name_or_path", "")),
        "num_experts": adapter.num_experts, "top_k": adapter.top_k, "moe_layers": list(adapter.moe_layers),
        "scoring": adapter.router_spec.scoring, "prompts": [p if isinstance(p, str) else None for p in prompts],
        "generated": generated, "decode_tokens": decode_tokens,
    }
    return Trace(
        experts=torch.cat(rows["experts"]), weights=torch.cat(rows["weights"]), logits=torch.cat(rows["logits"]),
        gate_inputs=torch.cat(rows["gate_inputs"]), router_weights=router_weights,
        token_ids=torch.tensor(token_ids), phase=torch.tensor(phase), prompt_id=torch.tensor(prompt_id),
        position=torch.tensor(position), meta=meta,
    )


def cross_layer_scores(trace: Trace) -> torch.Tensor:
    """Scores for layer l+1 predicted from layer l's gate input: [N, L-1, E] (Fate's prefetch signal)."""
    from fate_lab.predictors import cross_layer_scores as _scores

    if trace.gate_inputs is None or trace.router_weights is None:
        raise ValueError("this trace has no gate inputs/router weights (e.g. it came from a routing array); "
                         "record one with record_trace to use cross-layer prediction")
    return _scores(trace.gate_inputs, list(trace.router_weights), trace.meta.get("scoring", "softmax"))
