"""fate_lab: a real offloaded inference runtime for Mixture-of-Experts LMs, after Fate (arXiv 2502.12224).

Public entry points are imported lazily so ``import fate_lab`` stays fast:

    model, tok = fate_lab.load_model()                 # the default embedded model (data/tiny_moe)
    model, tok = fate_lab.load_model("tiny_deepseek")  # the second one, DeepSeek-V2-Lite-shaped
    trace = fate_lab.record_trace(model, tok, prompts, decode_tokens=64)
    rt = fate_lab.offload(model, fate_lab.OffloadConfig.preset("fate", budget=...))
    stats = fate_lab.simulate(trace, config, fate_lab.Hardware.scaled("qwen15_moe_rtx3090_pcie3"), shape)
    stats = fate_lab.replay(trace, config)      # runtime, simulator and replay all return a RunStats
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "fate_lab.model.models",
    "adapt": "fate_lab.model.adapters",
    "Trace": "fate_lab.model.trace",
    "record_trace": "fate_lab.model.record",
    "from_routing_array": "fate_lab.model.trace",
    "Runtime": "fate_lab.offloading.runtime",
    "load_offloaded": "fate_lab.offloading.load",
    "OffloadConfig": "fate_lab.core.config",
    "ModelShape": "fate_lab.core.shape",
    "RunStats": "fate_lab.policy.stats",
    "replay": "fate_lab.sim.replay",
    "Hardware": "fate_lab.hardware.setups",
    "SETUPS": "fate_lab.hardware.setups",
    "calibrate_compute": "fate_lab.fit.calibrate",
}

__all__ = sorted([*_EXPORTS, "offload", "simulate"])


def offload(model, config=None):
    """`fate_lab.offloading.runtime.offload` (the runtime's own docs), with a plan request (the `auto` / `auto_quant`
    presets) planned first on this model by `fate_lab.study.auto.resolve`: the planner sits above the drivers and
    is called here, explicitly, never from below."""
    from fate_lab.offloading.runtime import offload as run

    if config is not None and getattr(config, "auto", None) is not None:
        from fate_lab.study.auto import resolve

        config = resolve(config, model=model)
    return run(model, config)


def simulate(trace, config, hardware, shape, miss_curves=None, router=None, predictor=None):
    """`fate_lab.sim.simulate.simulate` (the simulator's own docs), with a plan request planned first from a
    calibration trace of the shape's model (never this trace) by `fate_lab.study.auto.resolve`."""
    from fate_lab.sim.simulate import simulate as run

    if getattr(config, "auto", None) is not None:
        from fate_lab.study.auto import resolve

        config = resolve(config, shape=shape, hardware=hardware)
    return run(trace, config, hardware, shape, miss_curves=miss_curves, router=router, predictor=predictor)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fate_lab' has no attribute {name!r}")
