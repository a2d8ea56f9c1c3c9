"""Sizing a deployment: any model from its config, any device and link from its specs, one answer per preset.

What it is: `plan(model, device, link, budget, context, trace, presets)` -> a `DeploymentPlan`: the model's
shape from its config (built on the meta device, no weights), the device's compute profile by the roofline
(`core/costs.py`), the memory plan of each preset (dense weights, KV cache at the context, buffers, expert slots
per layer), and, per preset, the timed simulator's predicted TTFT and decode tok/s with the hit rate, the
stall and the bytes moved per token, and the best preset. Routing comes from a trace: an embedded model's own,
one recorded (`python -m fate_lab trace`) or imported (`from_routing_array`), or -- when none is given -- an
embedded model's trace mapped onto the shape (`standin_trace`), and then the plan says so in words and marks
the presets whose figures do not depend on routing. `budget_sweep` is the design-review figure's data.
`python -m fate_lab plan` prints it; notebook 09 draws it.
What it is not: a measurement. Every number is a roofline estimate run through the simulator.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.costs import compute_for
from fate_lab.core.driver import DriverCore
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.devices import DEVICES, device
from fate_lab.hardware.links import LINK_PROFILES
from fate_lab.hardware.setups import Hardware
from fate_lab.model.trace import Trace
from fate_lab.paths import EMBEDDED_MODELS
from fate_lab.study.plan_model import ModelSpec, model_names, model_spec, parse_bytes, shape_from_config

DEFAULT_PRESETS = ("load_on_demand", "lru", "activation_path", "fate", "host_compute", "static_host", "all_host",
                   "lru_quant", "fate_quant")
# presets whose figures follow from bytes and FLOPs alone: every decode token moves or computes its own top-k
ROUTING_FREE = ("load_on_demand", "all_host")


def budget_steps(model: str, device_name: str, steps: int, context: int = 4096) -> list[float]:
    """`steps` budgets in GiB from just above the model's dense weights and KV cache to the device's memory (or
    to all weights resident, whichever is smaller), rounded to 3 significant digits."""
    from fate_lab.study.verdict import sig

    spec, dev = model_spec(model), device(device_name)
    s = spec.shape
    floor = (s.dense_bytes + s.kv_bytes_per_token * context) / 2**30
    top = min(dev.memory_gib, floor + s.nbytes(None) * s.num_moe_layers * s.num_experts / 2**30 * 1.05)
    lo = floor * 1.05 + s.nbytes(None) * s.top_k * 4 / 2**30  # the buffers' few experts
    if top <= lo:
        return [float(sig(top).replace(",", ""))]
    return sorted({float(sig(lo + (top - lo) * i / max(1, steps - 1)).replace(",", "")) for i in range(steps)})


def standin_trace(shape: ModelShape, source: str = "tiny_deepseek", fast: bool = True) -> Trace:
    """An embedded model's routing mapped onto a shape: layer l reads the embedded layer at the same depth, an
    expert id e becomes e x E / E_embedded (distinct ids kept, filled with the next free ids up to top-k). Token
    to token reuse and per-layer skew carry over; the experts' identities mean nothing."""
    from fate_lab.model.trace import from_routing_array
    from fate_lab.study.lab import get_trace

    src = get_trace(source, fast=fast)
    N, L0, _ = src.experts.shape
    E0, L, E, k = src.num_experts, shape.num_moe_layers, shape.num_experts, shape.top_k
    rows = src.experts.tolist()
    out = torch.empty(N, L, k, dtype=torch.int64)
    for t in range(N):
        for layer in range(L):
            ids = rows[t][min(L0 - 1, layer * L0 // L)]
            mapped = list(dict.fromkeys(e * E // E0 for e in ids))[:k]
            nxt = mapped[-1] if mapped else 0
            while len(mapped) < k:
                nxt = (nxt + 1) % E
                if nxt not in mapped:
                    mapped.append(nxt)
            out[t, layer] = torch.tensor(mapped)
    return from_routing_array(out, num_experts=E, phase=src.phase, prompt_id=src.prompt_id)


def _finite(v):
    """A value for strict JSON: NaN and infinities become None (null), containers recursively."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


@dataclass
class DeploymentPlan:
    """What `plan` answers: the setup, the memory plan and predicted speed per preset, and what they rest on."""

    model: str
    device: str
    link: str
    budget_bytes: int
    context: int
    routing: str  # where the routing came from, in words
    standin: bool
    memory: list[dict] = field(default_factory=list)  # one row per preset: dense, KV, buffers, slots
    rows: list[dict] = field(default_factory=list)  # one `RunStats.row` per preset, plus notes
    skipped: dict[str, str] = field(default_factory=dict)  # preset -> why it was not simulated (or does not fit)
    compute: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what a reader must know to read the numbers

    @property
    def best(self) -> str | None:
        """The preset with the highest predicted decode tok/s (lossless and quantized alike; only presets that fit
        are simulated, so only they are ranked)."""
        ok = [r for r in self.rows if isinstance(r["decode tok/s"], float) and math.isfinite(r["decode tok/s"])]
        return max(ok, key=lambda r: r["decode tok/s"])["config"] if ok else None

    def as_dict(self) -> dict:
        """The plan as plain values, missing ones None."""
        return _finite({**dataclasses.asdict(self), "best": self.best})

    def to_json(self) -> str:
        """The plan as strict JSON (missing values are null, never NaN)."""
        return json.dumps(self.as_dict(), indent=1, default=str, allow_nan=False)


def _quant_compute(shape: ModelShape, cfg: OffloadConfig, dev_name: str, host, spec, context: int):
    """The compute profile of a quantized preset: the runtime dequantizes a packed expert into a full-precision
    scratch and multiplies that, so one expert reads its packed bytes, writes and reads the scratch."""
    from fate_lab.core.sizing import slot_sizing
    from fate_lab.quant import QuantPolicy

    _, slot, _ = slot_sizing(QuantPolicy.preset(cfg.quant), shape.num_moe_layers, shape.expert_shapes(), shape.dtype,
                             shape.nbytes(None))
    return compute_for(shape, dev_name, host, spec.vocab_size, spec.tied, context // 2,
                       expert_bytes=slot + 2 * shape.nbytes(None))


def plan(model: str, device_name: str, budget: str | int | None = None, link: str | None = None, context: int = 4096,
         trace: str | Trace | None = None, presets=DEFAULT_PRESETS, host: str = "desktop_ddr4",
         dtype: torch.dtype = torch.bfloat16, fast: bool = True) -> DeploymentPlan:
    """Size one deployment (module docstring). ``budget`` None: the card's memory. ``host``: a host profile name
    (`hardware.hosts.HOST_PROFILES`) or a host spec (`hardware.host_specs.host_spec`). ``fast``: which size of the
    embedded trace stands in for the routing when no trace is given (`lab.sizes`)."""
    from fate_lab.hardware.engines import engine, host_profile_of
    from fate_lab.hardware.host_specs import host_spec
    from fate_lab.hardware.hosts import HOST_PROFILES
    from fate_lab.sim.simulate import needs_router, simulate

    dev = device(device_name)
    link = link or ("nvme" if dev.unified else dev.host_link)
    if link not in LINK_PROFILES:
        raise ValueError(f"--link {link!r}; choose one of {', '.join(sorted(LINK_PROFILES))}")
    if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= 1 << 20:
        raise ValueError(f"--context {context!r}: give the KV-cache tokens to plan for, a whole number from 1 to "
                         f"{1 << 20:,}")
    host_obj = None if host in HOST_PROFILES else host_profile_of(host_spec(host), engine("fate_lab"))
    host_prof = HOST_PROFILES[host] if host_obj is None else host_obj  # the runtime's host time scales by its clock
    spec = model_spec(model, dtype)
    shape = spec.shape
    card = int(dev.memory_gib * 2**30)
    budget_b = card if budget is None else parse_bytes(budget)
    if budget_b > card:
        raise ValueError(f"--budget {budget!r} is more than the {dev.name}'s {dev.memory_gib:g} GiB; give at most "
                         "the card's memory (or leave --budget out to use all of it)")
    tr, routing, standin = _routing(spec, trace, fast)
    compute = compute_for(shape, device_name, host_prof, spec.vocab_size, spec.tied, context // 2)
    hw = Hardware(compute, LINK_PROFILES[link], host=host_obj)
    out = DeploymentPlan(spec.name, device_name, link, budget_b, context, routing, standin,
                         compute=dataclasses.asdict(compute))
    out.notes.append(f"the runtime presets run the weights at {str(dtype).replace('torch.', '')} (the *_quant "
                     "presets pack experts as fate_lab's INT4/INT2); a GGUF or MXFP4 file's formats apply to "
                     "placements: --n-cpu-moe, --cpu-moe, -ngl, --cpu-only, --fit")
    all_experts = shape.nbytes(None) * shape.num_moe_layers * shape.num_experts
    for name in presets:
        cfg = OffloadConfig.preset(name, budget=budget_b, context_len=context,
                                   host_profile=host if host in HOST_PROFILES else "desktop_ddr4", link=link)
        need = shape.dense_bytes + shape.kv_bytes_per_token * context + all_experts
        if cfg.all_resident and need > budget_b:
            out.skipped[name] = (f"does not fit: every expert resident needs {need / 2**30:.2f} GiB (dense "
                                 f"{shape.dense_bytes / 2**30:.2f} + "
                                 f"KV {shape.kv_bytes_per_token * context / 2**30:.2f}"
                                 f" + experts {all_experts / 2**30:.2f}), budget {budget_b / 2**30:.2f} GiB")
            continue
        try:
            core = DriverCore(cfg, shape, hw, driver="simulator")
        except ValueError as exc:
            if "below the minimum working set" in str(exc):
                out.skipped[name] = f"does not fit: {str(exc).split(';')[0]}"
                continue
            out.skipped[name] = str(exc)
            continue
        p = core.plan
        out.memory.append({"config": name, "dense (GiB)": p.dense_bytes / 2**30, "KV cache (GiB)": p.kv_bytes / 2**30,
                           "buffers (GiB)": p.buffer_bytes / 2**30,
                           "experts cached (GiB)": p.cache_bytes / 2**30 if cfg.cache.keep or cfg.all_resident else 0.0,
                           "expert slots": sum(core.slots_per_layer), "slots per layer": list(core.slots_per_layer),
                           "share of experts": sum(core.slots_per_layer) / (shape.num_moe_layers * shape.num_experts)})
        if needs_router(cfg) and (tr.gate_inputs is None or tr.router_weights is None):
            out.skipped[name] = "needs a trace with gate inputs (record one: python -m fate_lab trace --model DIR)"
            continue
        run_hw = hw if cfg.quant is None else Hardware(_quant_compute(shape, cfg, device_name, host_prof, spec,
                                                                      context), hw.link, host=host_obj)
        row = simulate(tr, cfg, run_hw, shape).row(name)
        row["depends on routing"] = name not in ROUTING_FREE
        if not math.isfinite(row["TTFT (ms)"]):
            row["TTFT (ms)"] = None
            row["TTFT note"] = "the trace marks no prompt (prefill) tokens, so the prompt's time is unknown"
        out.rows.append(row)
    if not out.rows and all(v.startswith("does not fit") for v in out.skipped.values()) and out.skipped:
        floor = shape.dense_bytes + shape.kv_bytes_per_token * context
        raise ValueError(
            f"--budget {budget_b / 2**30:.2f} GiB is below the working set of every preset: {spec.name} at "
            f"{str(dtype).replace('torch.', '')} needs {shape.dense_bytes / 2**30:.2f} GiB of dense weights + "
            f"{shape.kv_bytes_per_token * context / 2**30:.2f} GiB of KV cache at --context {context} (= "
            f"{floor / 2**30:.2f} GiB) + a few experts; give a larger --budget (the {dev.name} has "
            f"{dev.memory_gib:g} GiB), a smaller --context, or a placement with a quantized file (--weights q4_k_m "
            "--n-cpu-moe N, or --fit)")
    return out


def _routing(spec: ModelSpec, trace, fast: bool = True) -> tuple[Trace, str, bool]:
    """(trace, what it is in words, stand-in?) for a plan."""
    from fate_lab.study.lab import get_trace

    if isinstance(trace, (str, Path)):
        try:
            trace = Trace.load(trace)
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"--trace {str(trace)!r} cannot be read as a routing trace: "
                             f"{str(exc).splitlines()[0][:200]} (record one: python -m fate_lab trace)") from None
    if trace is not None:
        s = spec.shape
        if (trace.num_layers, trace.top_k) != (s.num_moe_layers, s.top_k) or trace.num_experts > s.num_experts:
            raise ValueError(f"--trace has {trace.num_layers} MoE layers x top-{trace.top_k} of "
                             f"{trace.num_experts} experts; {spec.name} has {s.num_moe_layers} x top-{s.top_k} of "
                             f"{s.num_experts}: give a trace of this model")
        return trace, f"the given trace ({trace.num_tokens} tokens)", False
    if spec.name in EMBEDDED_MODELS:
        return get_trace(spec.name, fast=fast), f"{spec.name}'s own held-out trace", False
    src = "tiny_deepseek"
    note = (f"STAND-IN routing: {src}'s held-out trace mapped onto {spec.name}'s "
            f"{spec.shape.num_moe_layers} layers x {spec.shape.num_experts} experts "
            "(top-%d); only the presets marked as not depending on routing are "
            "predictions for this model" % spec.shape.top_k)
    return standin_trace(spec.shape, src, fast=fast), note, True


def budget_sweep(model: str, device_name: str, budgets, link: str | None = None, context: int = 4096,
                 presets=("load_on_demand", "lru", "fate", "host_compute", "fate_quant"), trace=None,
                 fast: bool = True) -> list[dict]:
    """Predicted decode tok/s of each preset at each budget (one row per (budget, preset)); budgets too small
    for the dense weights and the KV cache are left out."""
    rows = []
    for b in budgets:
        try:
            p = plan(model, device_name, b, link, context, trace, presets, fast=fast)
        except ValueError as exc:
            if "working set" in str(exc):
                continue
            raise
        for r in p.rows:
            rows.append({"budget (GiB)": parse_bytes(b) / 2**30, "config": r["config"],
                         "decode tok/s": r["decode tok/s"], "decode hit rate": r["decode hit rate"]})
    return rows


__all__ = ["DEFAULT_PRESETS", "DEVICES", "DeploymentPlan", "budget_steps", "budget_sweep", "model_names", "model_spec",
           "parse_bytes", "plan",
           "shape_from_config", "standin_trace"]
