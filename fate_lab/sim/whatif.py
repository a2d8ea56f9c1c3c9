"""What-if tables: hit rate and predicted speed of offloading configs, from the timed simulator.

What it is: the calls notebooks 04, 05 and the widgets make to ask the simulator (`simulate`)
"how fast would this config decode this trace on that hardware?": `machine_hardware` (this
machine, calibrated once per model and link from the runtime itself), `setup_hardware` (a named
real setup, on the trace's own expert size), `sim_row` / `sim_table` (one row per config).
What it is not: the simulator (`simulate.py`) or the runtime (`runtime.py`).
"""
from __future__ import annotations

import dataclasses

import pandas as pd

from fate_lab.offloading.config import OffloadConfig
from fate_lab.offloading.host import HostTime
from fate_lab.sim.calibrate import calibrate_compute
from fate_lab.sim.simulate import Hardware, ModelShape, simulate

_hw_cache: dict = {}


def machine_hardware(model, tokenizer, link: str = "qwen15_moe_rtx3090_pcie3") -> tuple[Hardware, float]:
    """(Hardware, layer seconds) of this machine running `model` with the emulated `link`, calibrated once
    per (model, link) in this process: the same layer time scales the runtime's link and the simulator's."""
    import torch
    from tqdm.auto import tqdm

    from fate_lab.model.adapters import adapt
    from fate_lab.offloading.links import resolve_link
    from fate_lab.offloading.runtime import calibrate_layer_time

    key = (id(model), link)
    if key not in _hw_cache:
        with tqdm(total=2, desc="calibrating this machine", unit="step", leave=False) as bar:
            layer_s = calibrate_layer_time(model, steps=24)
            bar.update()
            ids = torch.tensor([tokenizer("The expert cache holds the experts")["input_ids"]])
            timed = None if link == "instant" else link  # every other link is emulated on a CPU
            compute = calibrate_compute(model, ids, link=timed, layer_compute_s=layer_s)
            bar.update()
        a = adapt(model)
        prof = None if link == "instant" else resolve_link(link, a.bytes_per_expert(), layer_s)
        # host compute on this machine: the runtime's own rule (a scaled link charges the real setup's expert)
        ht = HostTime.for_run("desktop_ddr4", link, a.bytes_per_expert(),
                              6.0 * a.hidden_size * a.expert_intermediate_size, layer_s)
        _hw_cache[key] = (Hardware(compute, prof, (ht.expert_bytes, ht.flops_per_token, ht.scale)), layer_s)
    return _hw_cache[key]


def setup_hardware(name: str, shape: ModelShape) -> Hardware:
    """A named real setup (`simulate.SETUPS`) with its link scaled to this model's expert size."""
    return Hardware.setup(name, shape.nbytes(None))


def sim_row(trace, config: OffloadConfig, hardware: Hardware, shape: ModelShape, name: str | None = None) -> dict:
    """One row: decode/prefill hit rate, predicted decode tok/s and TTFT, stall and experts moved per token."""
    res = simulate(trace, config, hardware, shape)
    s = res.summary()
    d, p = s["decode"], s["prefill"]
    n = max(1, d["forwards"])
    return {"config": name or config.name, "slots": config.slots if config.slots is not None else sum(res.slots_per_layer),
            "hit rate decode": d["hit_rate"],
            "hit rate prefill": p["hit_rate"], "predicted decode tok/s": res.decode_tok_s,
            "predicted TTFT (ms)": 1e3 * res.ttft_s, "stall (ms/token)": 1e3 * d["stall_s"] / n,
            "experts moved per token": d["bytes_moved"] / shape.nbytes(None) / n if config.quant is None else float("nan"),
            "slots per layer": res.slots_per_layer}


def sim_table(trace, configs: dict[str, OffloadConfig], hardware: Hardware, shape: ModelShape,
              slots: list[int] | None = None) -> pd.DataFrame:
    """`sim_row` of every config (for every cache size in `slots`, if given), with a progress bar."""
    from tqdm.auto import tqdm

    jobs = [(n, c if s is None else dataclasses.replace(c, slots=s, budget=None))
            for s in (slots or [None]) for n, c in configs.items()]
    return pd.DataFrame([sim_row(trace, c, hardware, shape, n) for n, c in tqdm(jobs, desc="simulate", unit="run")])


def config_for(allocation: str, boundary: int, replacement: str, predictor: str, slots: int,
               calibration=None) -> OffloadConfig:
    """The runtime config a cache explorer's choices describe (prefetch as the `fate` preset moves it)."""
    from fate_lab.policy.allocation import lru_miss_curves
    from fate_lab.policy.predictors import Percentile

    base = OffloadConfig.preset("fate", slots=slots, replacement=replacement, allocation=allocation,
                                shallow_layers=boundary)
    if allocation == "miss_curve":
        if calibration is None:
            raise ValueError("allocation='miss_curve' needs a calibration trace")
        base = dataclasses.replace(base, miss_curves=tuple(map(tuple, lru_miss_curves(calibration.experts,
                                                                                     calibration.num_experts))))
    if predictor == "none (cache only)":
        return dataclasses.replace(base, predictor=None, prefetch_buffer_experts=None)
    if predictor == "cross-layer top-k":
        return dataclasses.replace(base, rule=None)  # the runtime's TopK(model's top_k)
    if predictor == "cross-layer percentile 75":
        return dataclasses.replace(base, rule=Percentile(75.0))
    raise ValueError(f"the simulator runs the predictors the runtime has; {predictor!r} is replay-only")


def ratio_curve(trace, configs: dict[str, OffloadConfig], compute, shape: ModelShape, layer_s: float,
                ratios=(0.25, 0.5, 1.0, 2.0, 2.9, 4.0), slots: int | None = None) -> pd.DataFrame:
    """Predicted decode tok/s of each config over links whose one-expert transfer takes r x `layer_s`
    (r = the transfer/compute ratio), on `compute`: one row per (ratio, config)."""
    from fate_lab.offloading.links import LinkProfile

    rows = []
    for r in ratios:
        link = LinkProfile(f"ratio {r}", shape.nbytes(None) / (r * layer_s), 0.0)
        hw = Hardware(compute, link)
        for name, cfg in configs.items():
            cfg = cfg if slots is None else dataclasses.replace(cfg, slots=slots, budget=None)
            rows.append({"ratio": r, "config": name, "decode tok/s": simulate(trace, cfg, hw, shape).decode_tok_s})
    return pd.DataFrame(rows)


def link_ratio(link: str, expert_bytes: int, layer_s: float) -> float:
    """The transfer/compute ratio r of a named link for an expert of expert_bytes and a layer of layer_s."""
    from fate_lab.offloading.links import resolve_link

    return resolve_link(link, expert_bytes, layer_s).transfer_time(expert_bytes) / layer_s
