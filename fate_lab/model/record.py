"""Recording a routing trace from a real run: prefill each prompt, greedy-decode, capture every MoE layer.

What this file is: `record_trace(model, tokenizer, prompts, decode_tokens)`, which runs the plain (not
offloaded) model with forward hooks on every MoE layer's router and experts module (`_Recorder`) and returns
a `Trace` holding, per token and layer, the experts, the applied weights, the router logits and the gate
input, plus every router's weight. What it is not: the trace format (`trace.py`) or a runtime.
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from fate_lab.model.adapters import adapt, is_offloaded
from fate_lab.model.routers import logit_bias
from fate_lab.model.trace import DECODE, PREFILL, Trace


class _Recorder:
    """Forward hooks that capture, per MoE layer, the gate input, logits and applied routing."""

    def __init__(self, adapter) -> None:
        self.adapter = adapter
        self.handles = []
        self.calls: dict[str, list] = {}
        for m in range(adapter.num_moe_layers):
            router = adapter.router(m)  # `gate` in most families, `router` in others: the adapter knows
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
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of strings or token-id lists, not a single string")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"prompts={prompts!r}: give a non-empty list of strings or token-id lists")
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) or decode_tokens < 0:
        raise ValueError(f"decode_tokens={decode_tokens!r}: give an int >= 0 (greedy decode steps per prompt)")
    if is_offloaded(model):
        raise RuntimeError("this model is offloaded by a fate_lab Runtime: record_trace needs the plain model "
                           "(its experts in place); close() the runtime first, then record")
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
            vocab = model.config.get_text_config().vocab_size if hasattr(model.config, "get_text_config") else \
                model.config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {p} holds token ids outside the model's vocabulary [0, {vocab}): {bad[:5]}")
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
    sites = [adapter.router_site(m) for m in range(adapter.num_moe_layers)]
    weights = [s.weight() for s in sites]
    # the [E, H] router weights, when every layer has one (an MLP router, e.g. ZAYA's, has none), and the
    # routers' logit biases when any has one (gpt-oss): what a simulator needs to predict as the runtime does
    router_weights = (None if any(w is None for w in weights)
                      else torch.stack([w.detach().float().cpu() for w in weights]))
    biases = [logit_bias(s) for s in sites]
    router_biases = None if router_weights is None or all(b is None for b in biases) else torch.stack(
        [torch.zeros(w.shape[0]) if b is None else b.detach().float().cpu()
         for w, b in zip(weights, biases, strict=True)])
    routers = adapter.host_routers()
    meta = {
        "source": "record_trace", "family": adapter.family, "model": str(getattr(model.config, "_name_or_path", "")),
        "num_experts": adapter.num_experts, "top_k": adapter.top_k, "moe_layers": list(adapter.moe_layers),
        "scoring": adapter.router_spec.scoring,
        "router_linear": all(routers.is_linear(m) for m in range(adapter.num_moe_layers)),
        "prompts": [p if isinstance(p, str) else None for p in prompts],
        "generated": generated, "decode_tokens": decode_tokens,
    }
    return Trace(
        experts=torch.cat(rows["experts"]), weights=torch.cat(rows["weights"]), logits=torch.cat(rows["logits"]),
        gate_inputs=torch.cat(rows["gate_inputs"]), router_weights=router_weights, router_biases=router_biases,
        token_ids=torch.tensor(token_ids), phase=torch.tensor(phase), prompt_id=torch.tensor(prompt_id),
        position=torch.tensor(position), meta=meta,
    )
