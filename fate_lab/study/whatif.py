"""What-if tables: hit rate and predicted speed of offloading configs, from the timed simulator.

What it is: the calls notebooks 04, 05 and the widgets make to ask the simulator (`simulate`) "how fast would
this config decode this trace on that hardware?": `machine_hardware` (this machine, calibrated once per model,
link and precision from the runtime itself), `setup_hardware` (a named real setup, its link fitted to whatever model
runs), `sim_row` / `sim_table` (one `RunStats.row` per config), `ratio_curve` (speed over transfer/compute
ratios) and `config_for` (the config an explorer's choices describe).
What it is not: the simulator (`sim/simulate.py`) or the runtime (`offloading/runtime.py`).
"""
from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.fit.calibrate import calibrate_compute
from fate_lab.hardware.links import LINK_PROFILES, LinkProfile
from fate_lab.hardware.setups import Hardware, run_hardware
from fate_lab.model.adapters import adapt
from fate_lab.sim.simulate import simulate


def checkpoint_expert_bytes(file) -> float:
    """Bytes of one routed expert in a safetensors file (every `.experts.` tensor over the experts they hold)."""
    import re

    from fate_lab.offloading.disk import safetensors_header

    _, header = safetensors_header(file)
    keys = [k for k in header if re.search(r"\.experts\.", k)]
    kinds = {re.sub(r"\.experts\.\d+\.", ".experts.", re.sub(r"layers\.\d+\.", "layers.", k)) for k in keys}
    experts = len(keys) / len(kinds) if kinds else 0  # (layer, expert) pairs
    if not experts:
        raise ValueError(f"{file}: no per-expert '.experts.<e>.' tensors to size the disk reads by")
    return sum(header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in keys) / experts


# model -> {(link, quant): (Hardware, layer_s, quick)}
_calibrated: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def machine_hardware(model, tokenizer, link: str = "qwen15_moe_rtx3090_pcie3",
                     fresh: bool = False, quant: str | None = None, quick: bool = False) -> tuple[Hardware, float]:
    """(Hardware, layer seconds) of this machine running `model` with the emulated `link` (or "disk": this machine's
    disk, measured now with O_DIRECT reads of the model's checkpoint): the run's one clock (`clock.machine_clock`,
    threads pinned) scales the runtime's link and the simulator's alike; the compute profile is calibrated once per
    (model, link, quant) in this process, threads pinned too (fresh: measure it all again, for a machine whose speed
    drifts between runs). quant: calibrate with the experts packed as `OffloadConfig.quant` packs them (e.g. "fate",
    what `lru_quant` and `fate_quant` run): predict a quantized preset with the profile of its own quant, since
    computing from packed slots slows the rest of the layer too (the dense part and the call's bookkeeping, measured
    on `tiny_moe`: 890 against 773 us, 80 against 68 us), which a full-precision calibration plus the dequantize
    timed alone misses (docs/disk.md). quick: a rougher calibration for FAST mode (one round of the disk's
    contention trials); a full one already made is reused, a quick one is never reused for a full one."""
    from tqdm.auto import tqdm

    from fate_lab.study.clock import machine_clock, pinned

    per_model = _calibrated.setdefault(model, {})
    key = (link, quant)
    if key not in per_model or fresh or (per_model[key][2] and not quick):
        disk = _measured_disk(model) if link == "disk" else None
        with tqdm(total=2, desc="calibrating this machine", unit="step", leave=False) as bar:
            layer_s = machine_clock(model).layer_s
            bar.update()
            ids = calibration_ids(tokenizer)
            timed = None if link == "instant" else link  # every other link is emulated on a CPU
            with pinned():
                compute = calibrate_compute(model, ids, link=timed, layer_compute_s=layer_s, link_profile=disk,
                                            quant=quant, quick=quick)
            bar.update()
        hw = dataclasses.replace(run_hardware(link, layer_s), compute=compute)
        if disk is not None:
            hw = dataclasses.replace(hw, link=disk)
        per_model[key] = (hw, layer_s, quick)
    return per_model[key][:2]


def _measured_disk(model) -> "LinkProfile":
    """This disk, measured now with O_DIRECT reads of the model's checkpoint (`fit/disk.py`) at the size of one of its
    experts, the bandwidth restated per byte of the model's dtype: the simulator counts an expert's bytes in the
    model's dtype, the disk reads the checkpoint's (x2 for a bfloat16 checkpoint run in float32)."""
    from fate_lab.fit.disk import SIZES, calibrate_disk
    from fate_lab.model.folder import weight_files

    file = max(weight_files(model.name_or_path), key=lambda f: f.stat().st_size)  # a shard holding experts
    read = checkpoint_expert_bytes(file)
    measured, _ = calibrate_disk(file, read_bytes=int(read), sizes=tuple(sorted({*SIZES, int(read) // 4096 * 4096})))
    scale = ModelShape.from_adapter(adapt(model)).nbytes() / read
    # the runtime reads with the "disk" profile's reader threads, whatever depth streamed fastest here
    return dataclasses.replace(measured, bandwidth=measured.bandwidth * scale,
                               queue_depth=LINK_PROFILES["disk"].queue_depth)


CALIBRATION_TOKENS = 128  # as long as the notebooks' prefills: the profile's per-token slopes are linear fits


def calibration_ids(tokenizer, tokens: int = CALIBRATION_TOKENS) -> "torch.Tensor":
    """The compute calibration's prompt: the first `tokens` tokens of the corpus's first training document
    (never a held-out prompt that a notebook then measures), shape (1, tokens)."""
    import torch

    from fate_lab.model.corpus import load_corpus

    text = load_corpus(split="train")[0]["text"]
    ids = tokenizer(text)["input_ids"][:tokens]
    if len(ids) < tokens:
        raise ValueError(f"the corpus's first training document has {len(ids)} tokens; the calibration needs {tokens}")
    return torch.tensor([ids])


def setup_hardware(name: str) -> Hardware:
    """A named real setup (`hardware.setups.SETUPS`) on its own clock, its link fitted to the model that runs."""
    return Hardware.scaled(name)


def link_words(link: str) -> str:
    """A link name as a reader reads it: a setup's link scaled to this machine, or a profile's own name."""
    from fate_lab.hardware.links import LINK_PROFILES
    from fate_lab.hardware.setups import SETUPS

    if link in SETUPS:
        s = SETUPS[link]
        return (f"{LINK_PROFILES[s.link].name} scaled to this machine's clock (the {s.model} setup "
                f"{s.name}: one expert's transfer = {s.ratio():.3g} decode-layer computes)")
    if link in LINK_PROFILES:
        return LINK_PROFILES[link].describe()
    return link


def describe(hardware: Hardware, expert_bytes: int | None = None) -> str:
    """One line naming a simulator's hardware: its link (concrete for `expert_bytes` when scaled) and compute."""
    hw = hardware.for_model(expert_bytes) if expert_bytes and hardware.scaled_from is not None else hardware
    if hw.scaled_from is not None:
        s = hw.scaled_from
        clock = "its own clock" if hw.layer_s is None else f"this machine's clock (one layer {hw.layer_s * 1e3:.3g} ms)"
        link = f"{s.name} link scaled to {clock}, one expert's transfer = {s.ratio():.3g} decode-layer computes"
    else:
        link = "instant link" if hw.link is None else hw.link.describe()
    return link + ("" if hw.compute is None else f"; compute: {hw.compute.name}")


def sim_row(trace, config: OffloadConfig, hardware: Hardware, shape: ModelShape, name: str | None = None) -> dict:
    """One `RunStats.row` of the simulator: speed, hit rates, stall and bytes per decode token."""
    return simulate(trace, config, hardware, shape).row(name or config.name)


SPEED_COLUMNS = ["decode tok/s", "decode tok/s spread", "predicted decode tok/s", "predicted / measured", "TTFT (ms)",
                 "TTFT spread", "predicted TTFT (ms)"]


def hardware_for(hardware: "Hardware | Mapping[str | None, Hardware]", config: OffloadConfig) -> Hardware:
    """The Hardware that predicts `config`: `hardware` itself, or from a mapping {quant: Hardware} the one calibrated
    at the config's `quant` (`machine_hardware(..., quant=)`: a quantized preset predicted from a full-precision
    calibration ran 1.11-1.24x too fast in decode over this machine's disk, docs/disk.md)."""
    if not isinstance(hardware, Mapping):
        return hardware
    if config.quant not in hardware:
        raise ValueError(f"no Hardware for quant={config.quant!r} (given: {sorted(map(str, hardware))}); calibrate one "
                         f"with machine_hardware(model, tokenizer, link, quant={config.quant!r})")
    return hardware[config.quant]


def with_prediction(table: pd.DataFrame, trace, configs: dict[str, OffloadConfig],
                    hardware: "Hardware | Mapping[str | None, Hardware]", shape: ModelShape) -> pd.DataFrame:
    """A `bench.compare_presets` table with the simulator's prediction of every config's run beside it (`sim_table`
    on the trace of the same prompt): predicted decode tok/s, predicted / measured, predicted TTFT (ms). hardware: one
    Hardware, or {quant: Hardware} to predict each config from the calibration at its own precision (`hardware_for`)."""
    pred = sim_table(trace, configs, hardware, shape).set_index("config")
    out = table.copy()
    out["predicted decode tok/s"] = pred["decode tok/s"]
    out["predicted / measured"] = out["predicted decode tok/s"] / out["decode tok/s"]
    out["predicted TTFT (ms)"] = pred["TTFT (ms)"]
    return out


def sim_table(trace, configs: dict[str, OffloadConfig], hardware: "Hardware | Mapping[str | None, Hardware]",
              shape: ModelShape, slots: list[int] | None = None) -> pd.DataFrame:
    """`sim_row` of every config (for every cache size in `slots`, if given: column ``cache size``, the slots
    asked for; ``slots`` is what the config got, e.g. 0 for load-on-demand), with a progress bar. hardware: one
    Hardware, or {quant: Hardware} (`hardware_for`)."""
    from tqdm.auto import tqdm

    jobs = [(n, s, c if s is None else c.replace(slots=s, budget=None))
            for s in (slots or [None]) for n, c in configs.items()]
    rows = [{**sim_row(trace, c, hardware_for(hardware, c), shape, n), "cache size": s}
            for n, s, c in tqdm(jobs, desc="simulate", unit="run")]
    return pd.DataFrame(rows)


def config_for(allocation: str, boundary: int, replacement: str, predictor: str, slots: int,
               calibration=None) -> OffloadConfig:
    """The runtime config a cache explorer's choices describe (prefetch as the `fate` preset moves it)."""
    from fate_lab.policy.allocation import lru_miss_curves
    from fate_lab.policy.rules import Percentile

    base = OffloadConfig.preset("fate", slots=slots, replacement=replacement, allocation=allocation,
                                shallow_layers=boundary)
    if allocation == "miss_curve":
        if calibration is None:
            raise ValueError("allocation='miss_curve' needs a calibration trace")
        base = base.replace(miss_curves=tuple(map(tuple, lru_miss_curves(calibration.experts,
                                                                                     calibration.num_experts))))
    if predictor == "none (cache only)":
        return base.replace(predictor=None, prefetch_buffer_experts=None)
    if predictor == "cross-layer top-k":
        return base.replace(rule=None)  # the runtime's TopK(model's top_k)
    if predictor == "cross-layer percentile 75":
        return base.replace(rule=Percentile(75.0))
    raise ValueError(f"the simulator runs the predictors the runtime has; {predictor!r} is replay-only")


def ratio_curve(trace, configs: dict[str, OffloadConfig], compute, shape: ModelShape, layer_s: float,
                ratios=(0.25, 0.5, 1.0, 2.0, 2.9, 4.0), slots: int | None = None) -> pd.DataFrame:
    """Predicted decode tok/s of each config over links whose one-expert transfer takes r x `layer_s`
    (r = the transfer/compute ratio), on `compute`: one row per (ratio, config)."""
    rows = []
    for r in ratios:
        hw = Hardware(compute, LinkProfile(f"ratio {r}", shape.nbytes(None) / (r * layer_s), 0.0))
        for name, cfg in configs.items():
            cfg = cfg if slots is None else cfg.replace(slots=slots, budget=None)
            rows.append({"ratio": r, "config": name, "decode tok/s": simulate(trace, cfg, hw, shape).decode_tok_s})
    return pd.DataFrame(rows)


def link_ratio(link: str, expert_bytes: int, layer_s: float) -> float:
    """The transfer/compute ratio r of a named link for an expert of expert_bytes and a layer of layer_s."""
    return run_hardware(link, layer_s).for_model(expert_bytes).transfer_s(expert_bytes) / layer_s
