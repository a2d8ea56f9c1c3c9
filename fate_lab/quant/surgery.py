"""Quality of quantized experts without the runtime: a model copy with dequantized experts, and its report.

What this file is: `quantize_model_experts` (a deep copy of a model whose routed experts are replaced by
their quantize-dequantize round trip, per policy, spec or single expert) and `quality_report`
(perplexity of both models, greedy agreement and mean KL per position).
What it is not: the offloaded runtime's quantized path (packed slots, `fate_lab/offloading/slots.py`).
"""
from __future__ import annotations

import copy
import math
from typing import Iterable, Mapping

import torch
from torch import nn

from fate_lab.quant.kernels import QuantSpec, quantize
from fate_lab.quant.policy import QuantPolicy


@torch.no_grad()
def quantize_model_experts(model: nn.Module, policy_or_spec: QuantPolicy | QuantSpec | None,
                           reason: str = "cache",
                           overrides: Mapping[tuple[int, int], QuantSpec | None] | None = None) -> nn.Module:
    """A deep copy of model whose routed experts are replaced by their dequantized weights.

    A QuantPolicy gives each MoE layer `policy.precision_for(m, reason)`; a QuantSpec applies to
    all; `overrides[(m, e)]` sets single experts (e.g. misses of a replayed trace at INT2). Every layout
    is quantized on its canonical view (`MoEAdapter.expert`: groups along the input dim of each
    projection, as the runtime's store packs it); biases stay at full precision.
    """
    from fate_lab.model.adapters import adapt

    q_model = copy.deepcopy(model)
    adapter, original = adapt(q_model), adapt(model)
    overrides = dict(overrides or {})
    for m in range(adapter.num_moe_layers):
        if isinstance(policy_or_spec, QuantPolicy):
            layer_spec = policy_or_spec.precision_for(m, reason)
        else:
            layer_spec = policy_or_spec
        for e in range(adapter.num_experts):
            spec = overrides.get((m, e), layer_spec)
            if spec is None:
                continue  # the copy holds the original weights
            mine, src = adapter.expert(m, e), original.expert(m, e)  # canonical views (R, H), (H, I)
            for name in ("gate_up", "down"):  # groups along the input dim, as the runtime's store packs them
                view = getattr(mine, name)
                q = quantize(getattr(src, name), spec, name=f"MoE layer {m} expert {e} {name}")
                view.copy_(q.dequantize(view.dtype))  # through the view: the module's own layout
    return q_model


@torch.no_grad()
def quality_report(model_fp: nn.Module, model_q: nn.Module, token_batches: Iterable[torch.Tensor],
                   progress: bool = True) -> dict:
    """Perplexity of both models, greedy next-token agreement and mean KL(fp || q) per position, and the
    sampling error of the perplexity change: ``ppl_change_uncertainty``, two standard errors of
    exp(mean d) - 1 over the per-position NLL differences d = nll_q - nll_fp (positions taken as independent,
    a lower bound), to first order exp(mean d) * 2 sd(d) / sqrt(n).

    token_batches: LongTensors [B, T] (or [T]) of unpadded token ids; every position but the
    last predicts the next token. A progress bar counts the batches (progress=False: none).
    """
    from tqdm.auto import tqdm

    nll_fp = nll_q = kl = agree = d2 = 0.0
    n = 0
    batches = list(token_batches)
    for ids in tqdm(batches, desc="quality", unit="window", disable=not progress, leave=False):
        ids = torch.as_tensor(ids, dtype=torch.long)
        ids = ids.unsqueeze(0) if ids.dim() == 1 else ids  # (B, T)
        ids = ids.to(next(model_fp.parameters()).device)
        lp_fp = model_fp(input_ids=ids).logits[:, :-1].double().log_softmax(-1)  # (B, T-1, V) fp64 for tiny KLs
        lp_q = model_q(input_ids=ids.to(next(model_q.parameters()).device)).logits[:, :-1].double()
        lp_q = lp_q.to(lp_fp.device).log_softmax(-1)  # (B, T-1, V)
        target = ids[:, 1:].unsqueeze(-1)  # (B, T-1, 1)
        pos_fp, pos_q = -lp_fp.gather(-1, target), -lp_q.gather(-1, target)  # (B, T-1, 1) per-position NLL
        nll_fp += pos_fp.sum().item()
        nll_q += pos_q.sum().item()
        d2 += ((pos_q - pos_fp) ** 2).sum().item()
        kl += (lp_fp.exp() * (lp_fp - lp_q)).sum().item()
        agree += (lp_fp.argmax(-1) == lp_q.argmax(-1)).sum().item()
        n += target.numel()
    if n == 0:
        raise ValueError("token_batches held no position to predict (need sequences of >= 2 tokens)")
    mean_d = (nll_q - nll_fp) / n
    sd = math.sqrt(max(0.0, d2 / n - mean_d ** 2) * n / (n - 1)) if n > 1 else float("nan")
    return {
        "perplexity_fp": math.exp(nll_fp / n),
        "perplexity_q": math.exp(nll_q / n),
        "ppl_change_uncertainty": math.exp(mean_d) * 2 * sd / math.sqrt(n),
        "greedy_agreement": agree / n,
        "mean_kl": kl / n,
        "n_tokens": n,
    }
