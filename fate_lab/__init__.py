"""fate_lab: a real offloaded inference runtime for Mixture-of-Experts LMs, after Fate (arXiv 2502.12224).

Public entry points are imported lazily so ``import fate_lab`` stays fast:

    model, tok = fate_lab.load_model()                 # the default embedded model (data/tiny_moe)
    model, tok = fate_lab.load_model("tiny_deepseek")  # the second one, DeepSeek-V2-Lite-shaped
    trace = fate_lab.record_trace(model, tok, prompts, decode_tokens=64)
    rt = fate_lab.offload(model, fate_lab.OffloadConfig.preset("fate", budget=...))
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load_model": "fate_lab.model.models",
    "adapt": "fate_lab.model.adapters",
    "Trace": "fate_lab.model.trace",
    "record_trace": "fate_lab.model.trace",
    "from_routing_array": "fate_lab.model.trace",
    "offload": "fate_lab.offloading.runtime",
    "OffloadConfig": "fate_lab.offloading.config",
    "simulate": "fate_lab.sim.simulate",
    "Hardware": "fate_lab.sim.simulate",
    "ModelShape": "fate_lab.sim.simulate",
    "calibrate_compute": "fate_lab.sim.calibrate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fate_lab' has no attribute {name!r}")
