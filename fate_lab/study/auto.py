"""The `auto` planner: the config a model decodes fastest with on a setup and a budget, chosen in the simulator.

What this file is: `plan_auto(calibration, shape, hardware, request)` -> `AutoPlan`. It scores every named preset
of its kind on a CALIBRATION trace with the timed simulator, then improves the best two by coordinate descent
over one knob at a time -- allocation (uniform, Fate's shallow-favoring, miss curves fitted on the calibration
trace), replacement (LRU, ARC, LFU, LRFU), prediction (none, cross-layer top-k / top-2k / 75th percentile,
learned probes where the model ships them), prefetching (link-sized windows, admission, by value one or two
layers ahead), host placement (none, Fiddler's cost rule, with background fill, the first MoE layers on the
host) and, for `auto_quant`, the precision mix (Fate's INT4/INT2, INT4 or INT8 everywhere, late prefetches at
INT2) -- so it may combine mechanisms no named preset combines. Lossless (`auto`: exact tokens) and quantized
(`auto_quant`) plans never mix. The trace a plan is scored on is never the one it decided from: callers hand in
the calibration split (`lab.get_trace(..., split="calib")`) or the first tokens of a run.
`resolve(config, shape, hardware, model)` is what `fate_lab.offload` and `fate_lab.simulate` call for a plan
request (the drivers below refuse one): with a model (`offload`) it calibrates this machine and records a short
calibration trace first; with a shape and a hardware (`simulate`) it uses the shape's model's calibration split.
What it is not: a driver, or a guarantee -- the pick is the simulator's best on the calibration trace.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.setups import Hardware
from fate_lab.model.trace import Trace
from fate_lab.policy.registry import policy_names
from fate_lab.policy.rules import Percentile, TopKPlus

LOSSLESS_START = ("load_on_demand", "lru", "mixtral_offloading", "activation_path", "eap", "fate", "fate_v1",
                  "fate_learned", "host_compute", "static_host", "all_host")
QUANT_START = ("lru_quant", "fate_quant", "fate_int8")
QUANTS = ("fate", "int4", "int8")  # never below Fate's own precisions (INT4 cached, INT2 misses)
MIN_GAIN = 0.005  # a move is kept when it decodes at least this much faster on the calibration trace
SIZE_FIELDS = ("budget", "slots", "slots_per_layer", "link", "context_len", "host_profile", "layer_compute_s",
               "calibration_steps", "transfer_timeout_s", "timeline", "timeline_max_events", "store", "checkpoint",
               "native_link")


@dataclass(frozen=True)
class AutoPlan:
    """The planner's pick and every candidate it scored (calibration decode tok/s, best first)."""

    config: OffloadConfig
    scores: tuple[tuple[str, float], ...]
    calibration_tokens: int

    def frame(self) -> pd.DataFrame:
        """The candidates as a table: name, calibration decode tok/s, and ratio to the pick."""
        df = pd.DataFrame(self.scores, columns=["candidate", "calibration decode tok/s"])
        return df.assign(**{"vs pick": df["calibration decode tok/s"] / self.scores[0][1]})

    def describe(self) -> str:
        """The pick in one line: the candidate's name and the knobs that make it."""
        return f"{self.scores[0][0]}: {describe_config(self.config)}"


def describe_config(c: OffloadConfig) -> str:
    """The knobs a plan turns, in words (allocation, replacement, prediction, prefetching, host, precision)."""
    parts = [f"allocation={c.allocation}", f"replacement={c.replacement}",
             f"predictor={c.predictor}" + ("" if c.predictor != "cross_layer_gate" else f"[{c.rule}]")]
    if c.predictor is not None:
        parts.append("prefetch by value" + (f", depth {c.prefetch_depth}" if c.prefetch_depth > 1 else "")
                     if c.prefetch_value else f"prefetch {c.prefetch_budget} x{c.prefetch_window:g}")
        parts.append(f"admit {c.admit_prefetch}")
    if c.host is not None:
        parts.append(f"host={c.host}" + (f"[{c.host_layers}]" if c.host == "layers" else "")
                     + (" + fill" if c.host_fill else ""))
    if c.quant is not None:
        parts.append(f"quant={c.quant}" + (" + late prefetches low" if c.prefetch_low else ""))
    return ", ".join(parts)


@dataclass(frozen=True)
class _Context:
    top_k: int
    curves: tuple  # LRU miss curves of the calibration trace (allocation="miss_curve")
    probes: bool  # the model ships learned probes (predictor="learned_gate")
    quant: bool


def _has_probes(shape: ModelShape, request: OffloadConfig) -> bool:
    from pathlib import Path

    from fate_lab.policy.probes import PROBES_FILE

    folder = request.probes or shape.source
    return bool(folder) and (Path(folder) / PROBES_FILE).is_file()


def _sized(cfg: OffloadConfig, request: OffloadConfig) -> OffloadConfig:
    """cfg with the request's cache size, link and run settings (and no plan request left)."""
    return cfg.replace(auto=None, **{f: getattr(request, f) for f in SIZE_FIELDS})


def _moves(c: OffloadConfig, ctx: _Context) -> list[tuple[str, OffloadConfig]]:
    """Every config one knob away from c (invalid combinations are left out)."""
    out: list[tuple[str, OffloadConfig]] = []

    def add(label: str, **kw) -> None:
        try:
            out.append((label, c.replace(**kw)))
        except ValueError:
            pass

    for a in ("uniform", "shallow", "miss_curve"):
        if a != c.allocation:
            add(f"allocation={a}", allocation=a, miss_curves=ctx.curves if a == "miss_curve" else None)
    for r in policy_names("classic"):
        if r != c.replacement:
            add(f"replacement={r}", replacement=r)
    plain = dict(prefetch_value=False, prefetch_depth=1, prefetch_low=False)
    if c.predictor is not None:
        add("no prediction", predictor=None, prefetch_buffer_experts=None, **plain)
    for label, rule in (("cross-layer top-k", None), ("cross-layer top-2k", TopKPlus(ctx.top_k, ctx.top_k)),
                        ("cross-layer p75", Percentile(75.0))):
        if c.predictor != "cross_layer_gate" or c.rule != rule:
            add(label, predictor="cross_layer_gate", rule=rule)
    if ctx.probes and c.predictor != "learned_gate":
        add("learned probes", predictor="learned_gate", prefetch_depth=1)
    if c.predictor is not None:
        for w in (1.0, 4.0):
            add(f"prefetch link x{w:g}", prefetch_budget="link", prefetch_window=w, **plain)
        add("prefetch by value", prefetch_value=True, prefetch_depth=1)
        add("prefetch by value, two layers ahead", prefetch_value=True, prefetch_depth=2)
        add("admit on " + ("load" if c.admit_prefetch == "on_use" else "use"),
            admit_prefetch="on_load" if c.admit_prefetch == "on_use" else "on_use")
    if ctx.quant:
        for q in QUANTS:
            if q != c.quant:
                add(f"quant={q}", quant=q)
        if c.prefetch_value:
            add("late prefetches " + ("full" if c.prefetch_low else "low"), prefetch_low=not c.prefetch_low)
    else:
        for label, kw in (("device only", dict(host=None, host_layers=0)), ("host by cost", dict(host="cost")),
                          ("host by cost + fill", dict(host="cost", host_fill=True)),
                          ("first MoE layer on the host", dict(host="layers", host_layers=1)),
                          ("first 2 MoE layers on the host", dict(host="layers", host_layers=2))):
            add(label, **{"host_fill": False, **kw})
    return out


def plan_auto(calibration: Trace, shape: ModelShape, hardware: Hardware, request: OffloadConfig | None = None,
              *, rounds: int = 2, keep: int = 2, progress: bool = False) -> AutoPlan:
    """The simulator's fastest config on the calibration trace (module docstring); request: the plan request
    (`OffloadConfig.preset("auto" | "auto_quant", slots=..., link=...)`) whose cache size and run settings the
    pick keeps (default: `auto`, every expert fits)."""
    from fate_lab.policy.allocation import lru_miss_curves
    from fate_lab.sim.simulate import simulate

    request = request if request is not None else OffloadConfig.preset("auto")
    if not isinstance(request, OffloadConfig) or request.auto is None:
        raise ValueError("plan_auto plans a request: give OffloadConfig.preset('auto' or 'auto_quant', ...)")
    if not isinstance(calibration, Trace):
        raise TypeError(f"calibration must be a Trace (the calibration split), got {type(calibration).__name__}")
    quant = request.auto == "quant"
    ctx = _Context(shape.top_k, tuple(map(tuple, lru_miss_curves(calibration.experts, shape.num_experts))),
                   _has_probes(shape, request), quant)
    seen: dict[OffloadConfig, float] = {}
    names: dict[OffloadConfig, str] = {}

    def score(label: str, cfg: OffloadConfig) -> float:
        cfg = _sized(cfg, request)
        if cfg not in seen:
            seen[cfg] = simulate(calibration, cfg, hardware, shape).decode_tok_s
            names[cfg] = label
        return seen[cfg]

    starts = []
    for name in QUANT_START if quant else LOSSLESS_START:
        base = OffloadConfig.preset(name)
        if base.predictor == "learned_gate" and not ctx.probes:
            continue
        try:
            _sized(base, request)
        except ValueError:  # a start the request's link refuses (host compute over link="disk")
            continue
        starts.append((score(name, base), name, _sized(base, request)))
    starts.sort(key=lambda s: -s[0])
    for _, label, cfg in starts[:keep]:
        best = seen[cfg]
        for _ in range(rounds):
            trials = [(score(f"{label} + {m}", c), f"{label} + {m}", c) for m, c in _moves(cfg, ctx)]
            top = max(trials, key=lambda t: t[0], default=None)
            if top is None or top[0] < best * (1 + MIN_GAIN):
                break
            best, label, cfg = top[0], top[1], _sized(top[2], request)
            if progress:
                print(f"auto: {label} {best:.1f} tok/s", flush=True)
    ranked = sorted(seen.items(), key=lambda kv: -kv[1])
    pick = ranked[0][0].replace(name=request.name)
    return AutoPlan(pick, tuple((names[c], v) for c, v in ranked), calibration.num_tokens)


# --- what fate_lab.offload and fate_lab.simulate call for OffloadConfig.preset("auto") ---------------------------
_resolved: dict = {}


def calibration_trace(shape: ModelShape, fast: bool = False) -> Trace:
    """The calibration split of the model a shape came from (its folder: `ModelShape.source`)."""
    from pathlib import Path

    from fate_lab.study.lab import get_trace

    if not shape.source or not (Path(shape.source) / "config.json").is_file():
        raise ValueError("an auto config needs a calibration trace of its model and this shape names no model folder: "
                         "plan it with fate_lab.study.auto.plan_auto(calibration_trace, shape, hardware, request)")
    return get_trace(shape.source, fast=fast, split="calib")


def resolve(config: OffloadConfig, shape: ModelShape | None = None, hardware: Hardware | None = None,
            model=None) -> OffloadConfig:
    """The concrete config a plan request stands for (see the module docstring); cached per request."""
    if model is not None:
        return _resolve_for_model(config, model)
    if shape is None or hardware is None or hardware.compute is None:
        raise ValueError(f"{config.name!r} is planned in the simulator: give a shape and a hardware with a compute "
                         "profile (e.g. Hardware.scaled(setup)), or offload(model, config) to plan on this machine")
    key = (config, shape, hardware)
    if key not in _resolved:
        _resolved[key] = plan_auto(calibration_trace(shape), shape, hardware, config).config
    return _resolved[key]


def _resolve_for_model(config: OffloadConfig, model) -> OffloadConfig:
    """Plan on this machine: its layer time and compute profile measured, a short calibration trace recorded."""

    from fate_lab.core.shape import model_source
    from fate_lab.fit.calibrate import calibrate_compute
    from fate_lab.hardware.setups import is_scaled, run_hardware
    from fate_lab.model.adapters import adapt
    from fate_lab.offloading.runtime import calibrate_layer_time

    shape = ModelShape.from_adapter(adapt(model))
    key = (config, shape, id(model))
    if key in _resolved:
        return _resolved[key]
    layer_s = config.layer_compute_s
    if is_scaled(config.link.name) and layer_s is None:
        layer_s = calibrate_layer_time(model, max(config.calibration_steps, 12))
    trace, ids = _short_calibration(model, model_source(model))
    compute = calibrate_compute(model, ids, link=None if config.link.name == "instant" else config.link.name,
                                layer_compute_s=layer_s, quant=config.quant if config.auto == "quant" else None)
    hw = dataclasses.replace(run_hardware(config.link.name, layer_s), compute=compute)
    request = config.replace(layer_compute_s=layer_s)
    _resolved[key] = plan_auto(trace, shape, hw, request).config
    return _resolved[key]


def _short_calibration(model, folder: str) -> tuple[Trace, "torch.Tensor"]:
    """A short trace of calibration-split prompts (the model's own tokenizer when its folder has one, else seeded
    random prompts) and one prompt's ids for timing."""
    from pathlib import Path

    import torch

    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.record import record_trace
    from fate_lab.study.lab import TRACE_SIZES

    size = TRACE_SIZES[True]
    n = size["prompts"]
    if folder and (Path(folder) / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        prompts = [tok(t)["input_ids"] for t in heldout_prompts(2 * n, max_chars=size["prompt_chars"])[n:]]
    else:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, model.config.vocab_size, (24,), generator=g).tolist() for _ in range(n)]
    trace = record_trace(model, None, prompts, decode_tokens=size["decode_tokens"], progress=False)
    return trace, torch.tensor([prompts[0]])
