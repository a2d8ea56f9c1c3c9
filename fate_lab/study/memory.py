"""Memory of real MoE models, from their published configs built on the meta device: what offloading saves.

What it is: `meta_model` (a published config of `hardware.models.PAPER_MODELS` built with no memory and no
download), `memory_breakdown` (dense vs expert bytes, bytes per expert and KV cache at a dtype),
`breakdown_table` (a model beside the paper's models), `expert_transfer_ms` (one expert over a link of given
bandwidth) and `transfer_table` (one expert, and all of a token's, over named links).
What it is not: the published facts themselves (`fate_lab/hardware/models.py`) or a measurement.
"""
from __future__ import annotations

import torch

from fate_lab.hardware.links import GB
from fate_lab.hardware.models import PAPER_MODELS


def meta_model(name: str):
    """One of ``PAPER_MODELS`` built on the meta device (shapes only, no memory, no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in PAPER_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(PAPER_MODELS)}")
    fields = dict(PAPER_MODELS[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def memory_breakdown(model, name: str, dtype: torch.dtype = torch.bfloat16, context_len: int = 2048) -> dict:
    """Dense vs expert bytes, bytes per expert and KV cache of a model at ``dtype``."""
    from fate_lab.model.adapters import adapt

    ad = adapt(model)
    scale = torch.empty((), dtype=dtype).element_size() / next(model.parameters()).element_size()
    per_expert = ad.bytes_per_expert(dtype)
    experts = per_expert * ad.num_experts * ad.num_moe_layers
    dense = int(ad.dense_bytes() * scale)
    kv = ad.kv_bytes_per_token(dtype) * context_len
    return {
        "model": name, "dtype": str(dtype).replace("torch.", ""), "moe_layers": ad.num_moe_layers,
        "experts_per_layer": ad.num_experts, "top_k": ad.top_k, "bytes_per_expert": per_expert,
        "dense_bytes": dense, "expert_bytes": experts, f"kv_bytes_at_{context_len}": kv,
        "expert_share": experts / (experts + dense),
        "active_expert_bytes_per_token": per_expert * ad.top_k * ad.num_moe_layers,
    }


def expert_transfer_ms(bytes_per_expert: int, link_gbps: float) -> float:
    """Milliseconds to move one expert over a link of ``link_gbps`` GB/s (bandwidth only)."""
    return bytes_per_expert / (link_gbps * GB) * 1e3


def breakdown_table(model, label: str, dtype: torch.dtype = torch.bfloat16, context_len: int = 2048):
    """`memory_breakdown` of `model` (named `label`) and of every published model of `PAPER_MODELS`, one row
    each, all at `dtype`."""
    import pandas as pd

    rows = [memory_breakdown(model, label, dtype, context_len)]
    rows += [memory_breakdown(meta_model(name), name, dtype, context_len) for name in PAPER_MODELS]
    kv = f"kv_bytes_at_{context_len}"
    return pd.DataFrame(rows).set_index("model").rename(columns={kv: f"KV cache bytes at {context_len:,} tokens"})


def describe_model(model) -> dict:
    """The shape facts a reader looks for first: family, layers, experts, top-k, widths, shared experts."""
    from fate_lab.model.adapters import adapt

    d = adapt(model).describe()
    return {"family": d["family"], "layers": d["num_layers"], "MoE layers": len(d["moe_layers"]),
            "experts per MoE layer": d["num_experts"], "top-k": d["top_k"], "hidden size": d["hidden_size"],
            "expert width": d["expert_intermediate_size"], "shared experts": d["has_shared_experts"],
            "router scoring": d["router"]["scoring"], "weights dtype": str(next(model.parameters()).dtype)[6:]}


def transfer_table(breakdown, links=("pcie3_x16", "pcie4_x16", "nvme"), all_over: str = "pcie3_x16"):
    """Milliseconds to move one routed expert over each named link (`hardware.links.LINK_PROFILES`, bandwidth
    and latency), and all of one token's routed experts (top-k in every MoE layer) over `all_over`."""
    import pandas as pd

    from fate_lab.hardware.links import link_profile

    out = pd.DataFrame(index=breakdown.index)
    for name in links:
        lp = link_profile(name)
        out[f"{lp.name}: ms per expert"] = [1e3 * lp.transfer_time(int(b)) for b in breakdown["bytes_per_expert"]]
    lp = link_profile(all_over)
    n = breakdown["top_k"] * breakdown["moe_layers"]
    out[f"a token's routed experts over {lp.name} (ms)"] = [
        1e3 * k * lp.transfer_time(int(b)) for k, b in zip(n, breakdown["bytes_per_expert"], strict=True)]
    return out
