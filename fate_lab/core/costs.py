"""What one forward of a model costs, in bytes and FLOPs, read off its shape: the roofline's input.

What this file is: `model_costs(shape, vocab_size, tied, context)` -> `hardware.roofline.ModelCosts`: one routed
expert (its bytes, 2 FLOPs per weight), one decoder layer's dense part (the non-expert weights, minus the
embeddings and the LM head, averaged over the decoder layers: a dense-only layer's MLP is spread over all of
them, as the simulator charges every layer the same dense time), the LM head, the KV cache a decode token reads
at a context, and the next layer's router on the host (fp32). And `compute_for`: the `ComputeProfile` of a shape
on a named device (`hardware/devices.py`), by the roofline.
What it is not: the roofline (`hardware/roofline.py`) or a measurement.
"""
from __future__ import annotations

from fate_lab.core.shape import ModelShape
from fate_lab.hardware.compute import ComputeProfile
from fate_lab.hardware.devices import device
from fate_lab.hardware.hosts import HostProfile, host_profile
from fate_lab.hardware.roofline import ModelCosts, derive_compute


def model_costs(shape: ModelShape, vocab_size: int = 0, tied: bool = False, context: int = 0,
                expert_bytes: float | None = None) -> ModelCosts:
    """The bytes and FLOPs of one token's forward pieces (module docstring); vocab_size 0: no head or embeddings known;
    expert_bytes: the bytes one routed expert's computation reads, where they differ from its full-precision size
    (a packed expert dequantized into a scratch; its FLOPs stay those of the full-precision expert)."""
    b = shape.dtype.itemsize
    embed = vocab_size * shape.hidden * b  # the embedding table (a lookup reads one row)
    head = embed  # the LM head reads a [V, H] matrix per forward (the embedding itself when tied)
    in_layers = max(0, shape.dense_bytes - embed - (0 if tied else head))
    layer = in_layers / shape.num_layers
    expert = shape.nbytes(None)
    return ModelCosts(dense_layer_bytes=layer, dense_layer_flops=2 * layer / b,
                      expert_bytes=expert if expert_bytes is None else expert_bytes,
                      expert_flops=2 * expert / b, head_bytes=head,
                      kv_layer_bytes=shape.kv_bytes_per_token * context / shape.num_layers,
                      router_host_bytes=4 * shape.num_experts * shape.hidden, num_layers=shape.num_layers)


def compute_for(shape: ModelShape, device_name: str, host: str | HostProfile = "desktop_ddr4", vocab_size: int = 0,
                tied: bool = False, context: int = 0, expert_bytes: float | None = None) -> ComputeProfile:
    """The roofline `ComputeProfile` of a model shape on a named device, the prediction and the runtime's host time
    on a host CPU (a profile or its name; expert_bytes: as `model_costs`)."""
    dev = device(device_name)
    hp = host if isinstance(host, HostProfile) else host_profile(host)
    return derive_compute(model_costs(shape, vocab_size, tied, context, expert_bytes), dev, hp,
                          f"roofline: {dev.name}")


_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "kv_b_proj": "attn_v", "o_proj": "attn_o"}


def _layer_class(rest: str, ndim: int) -> str:
    """The tensor class (`hardware/formats.CLASSES`) of a parameter named `rest` inside a decoder layer."""
    if ndim < 2 or "norm" in rest:
        return "norm"
    routers = ("mlp.router", "mlp.shared_expert_gate")
    if ".gate." in f".{rest}" and rest.startswith("mlp.gate") or rest.startswith(routers):
        return "router"
    down = "down" in rest
    if rest.startswith("mlp.shared_expert"):
        return "shexp_down" if down else "shexp_gate_up"
    if "attn" in rest.split(".")[0]:
        proj = rest.split(".")[1] if "." in rest else ""
        return _ATTN.get(proj, "attn_other")
    return "ffn_down" if down else "ffn_gate_up"


def model_params(model, name: str, top_k: int, kv_bytes_per_token: float = 0.0):
    """A `hardware.params.ModelParams` of a (meta-device) transformers model: every parameter counted by tensor
    class and layer; the routed experts (`mlp.experts.*`, fused [E, ...] tensors) counted per expert."""
    from collections import defaultdict

    from fate_lab.hardware.params import LayerParams, ModelParams

    body = getattr(model, "model", model)
    n = len(body.layers)
    dense = [defaultdict(int) for _ in range(n)]
    experts = [dict(experts=0, expert_gate_up=0, expert_down=0, expert_bias=0) for _ in range(n)]
    embed = head = other = 0
    for pname, p in model.named_parameters():
        parts = pname.split(".")
        if "layers" in parts and parts[parts.index("layers") + 1].isdigit():
            i = int(parts[parts.index("layers") + 1])
            rest = ".".join(parts[parts.index("layers") + 2:])
            if rest.startswith("mlp.experts."):
                e = p.shape[0]
                key = "expert_bias" if rest.endswith("bias") else "expert_down" if "down" in rest else "expert_gate_up"
                experts[i]["experts"] = e
                experts[i][key] += p.numel() // e
            else:
                dense[i][_layer_class(rest, p.dim())] += p.numel()
        elif "embed" in pname:
            embed += p.numel()
        elif "lm_head" in pname:
            head += p.numel()
        else:
            other += p.numel()
    cfg = model.config
    heads, kv = getattr(cfg, "num_attention_heads", 1) or 1, getattr(cfg, "num_key_value_heads", None) or 1
    layers = tuple(LayerParams(tuple(sorted(d.items())), kv_bytes_per_token=kv_bytes_per_token / n, **x)
                   for d, x in zip(dense, experts, strict=False))
    return ModelParams(name, layers, embed, head, other, top_k, int(cfg.hidden_size), max(1, heads // kv))
