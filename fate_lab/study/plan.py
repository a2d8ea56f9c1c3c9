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
import re
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
from fate_lab.paths import DATA_DIR, EMBEDDED_MODELS

CONFIGS_DIR = DATA_DIR / "configs"  # published configs, each with its source.md
DEFAULT_PRESETS = ("load_on_demand", "lru", "activation_path", "fate", "host_compute", "static_host", "all_host",
                   "lru_quant", "fate_quant")
# presets whose figures follow from bytes and FLOPs alone: every decode token moves or computes its own top-k
ROUTING_FREE = ("load_on_demand", "all_host")
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'12GiB', '16 GB', '500MiB' or an int -> bytes (binary units: KiB, MiB, GiB; decimal: KB, MB, GB)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"budget {text!r}: give a number with a unit, e.g. 12GiB, 16GB, 500MiB (units: "
                         f"{', '.join(u for u in _UNITS if u)})")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class ModelSpec:
    """A model as the sizing tool knows it: its shape at the precision that runs, and its vocabulary."""

    name: str
    shape: ModelShape
    vocab_size: int
    tied: bool
    source: str  # where the config came from


def model_names() -> list[str]:
    """Every model `plan` knows by name: the embedded models, then the published configs of `data/configs` whose
    model type this transformers has (a config of a family it lacks, e.g. DeepSeek-MoE's `deepseek`, is left
    out: it could not be built)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    published = [d.name for d in CONFIGS_DIR.iterdir() if (d / "config.json").is_file()
                 and json.loads((d / "config.json").read_text()).get("model_type") in CONFIG_MAPPING]
    return list(EMBEDDED_MODELS) + sorted(published)


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


def model_spec(model: str, dtype: torch.dtype = torch.bfloat16) -> ModelSpec:
    """An embedded model's name, a published model's name (`data/configs`), a checkpoint folder or a config.json."""
    from transformers import AutoConfig

    if model in EMBEDDED_MODELS:
        path = EMBEDDED_MODELS[model] / "config.json"
    elif (CONFIGS_DIR / model / "config.json").is_file():
        path = CONFIGS_DIR / model / "config.json"
    else:
        p = Path(model)
        path = p / "config.json" if p.is_dir() else p
        if not path.is_file():
            known = sorted(EMBEDDED_MODELS) + sorted(d.name for d in CONFIGS_DIR.iterdir() if d.is_dir())
            raise ValueError(f"--model {model!r}: not an embedded or published model ({', '.join(known)}), nor a "
                             "checkpoint folder with config.json, nor a config.json file")
    raw = json.loads(path.read_text())
    cfg = AutoConfig.for_model(raw.pop("model_type"), **{k: v for k, v in raw.items() if k not in ("architectures",
                                                                                                 "auto_map")})
    shape = shape_from_config(cfg, dtype)
    return ModelSpec(model, shape, int(getattr(cfg, "vocab_size", 0) or 0), bool(getattr(cfg, "tie_word_embeddings",
                                                                                       False)), str(path))


def shape_from_config(cfg, dtype: torch.dtype) -> ModelShape:
    """The shape of a config's model, built on the meta device (no weights, no memory) at `dtype`."""
    from transformers import AutoModelForCausalLM

    from fate_lab.model.adapters import adapt

    cfg = dataclasses.replace(cfg) if dataclasses.is_dataclass(cfg) else cfg
    if hasattr(cfg, "quantization_config"):  # e.g. gpt-oss's MXFP4 on disk: size it at `dtype`, as it would run
        delattr(cfg, "quantization_config")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    a = adapt(model)
    item = dtype.itemsize
    scale = item / next(model.parameters()).element_size()
    return ModelShape(len(getattr(model, "model", model).layers), a.num_moe_layers, a.num_experts, a.top_k,
                      a.hidden_size, a.expert_intermediate_size, dtype, int(a.dense_bytes() * scale),
                      int(a.kv_bytes_per_token(dtype)))


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
    skipped: dict[str, str] = field(default_factory=dict)  # preset -> why it was not simulated
    compute: dict = field(default_factory=dict)

    @property
    def best(self) -> str | None:
        """The preset with the highest predicted decode tok/s (lossless and quantized alike)."""
        ok = [r for r in self.rows if r["decode tok/s"] == r["decode tok/s"]]
        return max(ok, key=lambda r: r["decode tok/s"])["config"] if ok else None

    def to_json(self) -> str:
        """The plan as JSON (for scripts)."""
        return json.dumps({**dataclasses.asdict(self), "best": self.best}, indent=1, default=str)


def plan(model: str, device_name: str, budget: str | int, link: str | None = None, context: int = 4096,
         trace: str | Trace | None = None, presets=DEFAULT_PRESETS, host: str = "desktop_ddr4",
         dtype: torch.dtype = torch.bfloat16, fast: bool = True) -> DeploymentPlan:
    """Size one deployment (module docstring). ``fast``: which size of the embedded trace stands in for the
    routing when no trace is given (`lab.sizes`)."""
    from fate_lab.sim.simulate import needs_router, simulate

    dev = device(device_name)
    link = link or ("nvme" if dev.unified else dev.host_link)
    if link not in LINK_PROFILES:
        raise ValueError(f"--link {link!r}; choose one of {sorted(LINK_PROFILES)}")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"--context {context!r}: give the KV-cache tokens to plan for, an int >= 1")
    spec = model_spec(model, dtype)
    shape, budget_b = spec.shape, parse_bytes(budget)
    if budget_b > dev.memory_gib * 2**30:
        raise ValueError(f"--budget {budget!r} is more than the {dev.name}'s {dev.memory_gib:g} GiB")
    tr, routing, standin = _routing(spec, trace, fast)
    compute = compute_for(shape, device_name, host, spec.vocab_size, spec.tied, context // 2)
    hw = Hardware(compute, LINK_PROFILES[link])
    out = DeploymentPlan(spec.name, device_name, link, budget_b, context, routing, standin,
                         compute=dataclasses.asdict(compute))
    for name in presets:
        cfg = OffloadConfig.preset(name, budget=budget_b, context_len=context, host_profile=host, link=link)
        try:
            core = DriverCore(cfg, shape, hw, driver="simulator")
        except ValueError as exc:
            if "below the minimum working set" in str(exc):
                raise ValueError(f"--budget {budget!r}: {exc}") from None
            out.skipped[name] = str(exc)
            continue
        p = core.plan
        out.memory.append({"config": name, "dense (GiB)": p.dense_bytes / 2**30, "KV cache (GiB)": p.kv_bytes / 2**30,
                           "buffers (GiB)": p.buffer_bytes / 2**30, "experts cached (GiB)": p.cache_bytes / 2**30,
                           "expert slots": sum(core.slots_per_layer), "slots per layer": list(core.slots_per_layer),
                           "share of experts": sum(core.slots_per_layer) / (shape.num_moe_layers * shape.num_experts)})
        if needs_router(cfg) and (tr.gate_inputs is None or tr.router_weights is None):
            out.skipped[name] = "needs a trace with gate inputs (record one: python -m fate_lab trace --model DIR)"
            continue
        row = simulate(tr, cfg, hw, shape).row(name)
        row["depends on routing"] = name not in ROUTING_FREE
        out.rows.append(row)
    return out


def _routing(spec: ModelSpec, trace, fast: bool = True) -> tuple[Trace, str, bool]:
    """(trace, what it is in words, stand-in?) for a plan."""
    from fate_lab.study.lab import get_trace

    if isinstance(trace, (str, Path)):
        trace = Trace.load(trace)
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
    return standin_trace(spec.shape, src, fast=fast), (f"STAND-IN routing: {src}'s held-out trace mapped onto {spec.name}'s "
                                            f"{spec.shape.num_moe_layers} layers x {spec.shape.num_experts} experts "
                                            "(top-%d); only the presets marked as not depending on routing are "
                                            "predictions for this model" % spec.shape.top_k), True


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
            if "minimum working set" in str(exc):
                continue
            raise
        for r in p.rows:
            rows.append({"budget (GiB)": parse_bytes(b) / 2**30, "config": r["config"], "decode tok/s": r["decode tok/s"],
                         "decode hit rate": r["decode hit rate"]})
    return rows


__all__ = ["DEFAULT_PRESETS", "DEVICES", "DeploymentPlan", "budget_steps", "budget_sweep", "model_names", "model_spec",
           "parse_bytes", "plan",
           "shape_from_config", "standin_trace"]
