"""Statically placed deployments (llama.cpp's flags, any engine) and `plan --fit`: what fits, and how fast.

What it is: `Setting` (a model at a weight format on a device, a host with its RAM and disk, an engine, the
context and prompt: everything but the placement), `setting(...)` (built from the command line's names and
specs, every bad value one clear line naming its flag), `predict_placement(setting, placement)` (the memory
and speed of one placement, `hardware/static_speed.py`), `fit(setting)` -> `FitResult` (every `--n-cpu-moe`
and every `-ngl` predicted, the smallest `--n-cpu-moe` and the best `-ngl` that fit with llama.cpp's 1 GiB
margin, the largest context that still fits, the llama.cpp flags, and the fate_lab engine on the same
placements beside them) and `n_cpu_moe_sweep` (notebook 09's design-review figure: decode tok/s against
`--n-cpu-moe`, one line per format). No trace is needed: a static placement computes each token's own top-k.
What it is not: the runtime presets (`study/plan.py`, the simulator over a trace).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fate_lab.hardware.devices import DeviceSpec, device
from fate_lab.hardware.disks import disk as parse_disk
from fate_lab.hardware.engines import Engine, engine
from fate_lab.hardware.formats import WeightFormat, weight_format
from fate_lab.hardware.host_specs import HostSpec, host_spec, parse_ram
from fate_lab.hardware.links import LINK_PROFILES, LinkProfile
from fate_lab.hardware.placements import ALL, Placement
from fate_lab.hardware.static_speed import FIT_MARGIN_BYTES, Deployment, StaticPrediction, predict
from fate_lab.study.plan_model import ModelSpec, model_spec, parse_bytes

MAX_CONTEXT = 1 << 20  # the largest context --fit tries (1M tokens)


@dataclass(frozen=True)
class Setting:
    """Everything of a deployment but its placement."""

    spec: ModelSpec
    fmt: WeightFormat
    device: DeviceSpec | None
    host: HostSpec
    engine: Engine
    link: LinkProfile | None
    disk: LinkProfile | None
    gpus: int = 1
    context: int = 4096
    prompt: int = 512
    budget_bytes: float | None = None

    def deployment(self, placement: Placement, context: int | None = None) -> Deployment:
        """This setting with a placement (and another context)."""
        return Deployment(self.spec.params, self.fmt, placement, self.device, self.host, self.engine, self.link,
                          self.disk, self.gpus, context or self.context, self.prompt, self.budget_bytes)

    def describe(self) -> str:
        """One line: model, format, device, host, engine."""
        dev = "no GPU" if self.device is None else (f"{self.gpus} x " if self.gpus > 1 else "") + self.device.name
        disk = "" if self.disk is None else f", disk {self.disk.name}"
        return (f"{self.spec.name} at {self.fmt.name} on {dev}; host {self.host.describe()}{disk}; engine "
                f"{self.engine.name}; context {self.context:,}, prompt {self.prompt:,} tokens")


def _whole(value, flag: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{flag} {value!r}: give a whole number from {lo:,} to {hi:,}")
    return value


def setting(model: str, device_name: str | None, host: str = "desktop_ddr4", engine_name: str = "llama.cpp",
            weights: str | None = None, expert_weights: str | None = None, host_ram: str | None = None,
            disk: str | None = None, link: str | None = None, gpus: int = 1, context: int = 4096,
            prompt: int = 512, budget: str | int | None = None) -> Setting:
    """A `Setting` from names and specs as the command line gives them (each checked, one line per bad value).
    The weight format is `weights`, else the format the config declares (gpt-oss: mxfp4, DeepSeek-V3: fp8),
    else bf16; `expert_weights` overrides the routed experts' format alone."""
    _whole(context, "--context", 1, MAX_CONTEXT)
    _whole(prompt, "--prompt", 1, MAX_CONTEXT)
    _whole(gpus, "--gpus", 1, 64)
    dev = None if device_name in (None, "none", "cpu") else device(device_name)
    spec = model_spec(model)
    fmt = weight_format(weights or spec.declared or "bf16")
    if expert_weights is not None:
        fmt = fmt.with_experts(weight_format(expert_weights, "--expert-weights"))
    hs = host_spec(host).with_ram(parse_ram(host_ram))
    eng = engine(engine_name)
    lk = None
    if dev is not None and not dev.unified:
        name = link or dev.host_link
        if name not in LINK_PROFILES:
            raise ValueError(f"--link {name!r}; choose one of {', '.join(sorted(LINK_PROFILES))}")
        lk = LINK_PROFILES[name]
    dk = None if disk is None else parse_disk(disk)
    budget_b = None
    if budget is not None:
        budget_b = parse_bytes(budget)
        if dev is not None and budget_b > dev.memory_gib * 2**30 * gpus:
            raise ValueError(f"--budget {budget!r} is more than the {gpus} x {dev.name}'s {dev.memory_gib:g} GiB; "
                             "give at most the card's memory")
    return Setting(spec, fmt, dev, hs, eng, lk, dk, gpus, context, prompt, budget_b)


def placement(n_cpu_moe: int | None = None, cpu_moe: bool = False, n_gpu_layers: int | None = None,
              cpu_only: bool = False) -> Placement:
    """llama.cpp's flags as a `Placement` (defaults: -ngl 999, nothing forced onto the CPU)."""
    if cpu_only:
        return Placement(n_gpu_layers=0)
    return Placement(ALL if n_gpu_layers is None else n_gpu_layers, n_cpu_moe or 0, cpu_moe)


def predict_placement(s: Setting, p: Placement, context: int | None = None) -> StaticPrediction:
    """Memory, fit and speed of one placement of a setting."""
    if s.device is None and not p.cpu_only:
        p = Placement(n_gpu_layers=0)
    return predict(s.deployment(p, context))


@dataclass
class FitResult:
    """What `plan --fit` answers."""

    setting: Setting
    n_cpu_moe: list = field(default_factory=list)  # one StaticPrediction per --n-cpu-moe N (0..layers)
    ngl: list = field(default_factory=list)  # one per -ngl N (0..layers + 1)
    best_n_cpu_moe: int | None = None  # the smallest that fits (None: none fits)
    best_ngl: int | None = None  # the largest that fits
    best: StaticPrediction | None = None  # the fastest fitting candidate, llama.cpp's flags
    max_context: int | None = None  # the largest context the best candidate still fits at
    fate_lab: StaticPrediction | None = None  # the fate_lab engine on the fastest fitting placement


def _fitting(s: Setting) -> Setting:
    """The setting with llama.cpp's --fit margin taken off the budget."""
    if s.device is None:
        return s
    cap = s.budget_bytes if s.budget_bytes is not None else s.device.memory_gib * 2**30 * s.gpus
    return dataclasses.replace(s, budget_bytes=max(0.0, cap - FIT_MARGIN_BYTES))


def fit(s: Setting) -> FitResult:
    """Every --n-cpu-moe and -ngl predicted, the fitting ones ranked by decode speed (never one that does not fit),
    the largest context of the best, and the fate_lab engine on the same placement."""
    f = _fitting(s)
    n = s.spec.params.n_layers
    out = FitResult(s)
    if s.device is None:
        out.best = predict_placement(f, Placement(n_gpu_layers=0))
        out.best = out.best if out.best.fits else None
    else:
        out.n_cpu_moe = [predict_placement(f, Placement(ALL, k)) for k in range(n + 1)]
        out.ngl = [predict_placement(f, Placement(k)) for k in range(n + 2)]
        out.best_n_cpu_moe = next((k for k, r in enumerate(out.n_cpu_moe) if r.fits), None)
        out.best_ngl = max((k for k, r in enumerate(out.ngl) if r.fits), default=None)
        ok = [r for r in out.n_cpu_moe + out.ngl if r.fits]
        out.best = max(ok, key=lambda r: r.decode_tok_s) if ok else None
    if out.best is not None:
        best_p = _placement_of(out, n)
        out.max_context = _largest_context(f, best_p)
        fl = dataclasses.replace(f, engine=engine("fate_lab"))
        out.fate_lab = predict_placement(fl, best_p)
    return out


def _placement_of(r: FitResult, n: int) -> Placement:
    if r.setting.device is None:
        return Placement(n_gpu_layers=0)
    for k, p in enumerate(r.n_cpu_moe):
        if p is r.best:
            return Placement(ALL, k)
    return Placement(next(k for k, p in enumerate(r.ngl) if p is r.best))


def _largest_context(s: Setting, p: Placement) -> int | None:
    """The largest context (a multiple of 256) at which placement p still fits (binary search; KV grows linearly)."""
    lo, hi = 0, MAX_CONTEXT // 256
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if predict_placement(s, p, mid * 256).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * 256 or None


def n_cpu_moe_sweep(model: str, device_name: str, formats=("q4_k_m", "q8_0", "bf16"), **kw) -> list[dict]:
    """Decode tok/s against --n-cpu-moe for each format (None where it does not fit): the design-review figure."""
    rows = []
    for name in formats:
        s = _fitting(setting(model, device_name, weights=name, **kw))
        for k in range(s.spec.params.n_layers + 1):
            r = predict_placement(s, Placement(ALL, k))
            rows.append({"format": name, "--n-cpu-moe": k, "decode tok/s": r.decode_tok_s, "fits": r.fits,
                         "GPU (GiB)": r.gpu_bytes / 2**30})
    return rows
