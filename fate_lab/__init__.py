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
    "offload": "fate_lab.offloading.runtime",
    "Runtime": "fate_lab.offloading.runtime",
    "load_offloaded": "fate_lab.offloading.load",
    "OffloadConfig": "fate_lab.core.config",
    "ModelShape": "fate_lab.core.shape",
    "RunStats": "fate_lab.policy.stats",
    "simulate": "fate_lab.sim.simulate",
    "replay": "fate_lab.sim.replay",
    "Hardware": "fate_lab.hardware.setups",
    "SETUPS": "fate_lab.hardware.setups",
    "calibrate_compute": "fate_lab.fit.calibrate",
}

__all__ = sorted(_EXPORTS)


def _plan_request(config, shape, hardware, model):
    """Resolve an `auto` / `auto_quant` config with the planner (imported only when one is asked for)."""
    from fate_lab.study.auto import resolve

    return resolve(config, shape=shape, hardware=hardware, model=model)


def _register_planner() -> None:
    from fate_lab.core import autoplan

    autoplan.set_resolver(_plan_request)


_register_planner()


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fate_lab' has no attribute {name!r}")
