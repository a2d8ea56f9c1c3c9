"""The seam through which a plan request (`OffloadConfig.auto`: the `auto` / `auto_quant` presets) is resolved.

What this file is: one registered resolver and `resolved(config, shape, hardware, model=None)`, which every entry
point calls before it builds a driver -- `offload()` (with the model: the planner calibrates on it), `simulate()`
and the driver core (with a shape and a hardware that has a compute profile). The planner itself runs the timed
simulator, so it lives above the drivers (`fate_lab/study/auto.py`); the package root registers it lazily
(`fate_lab/__init__.py`), so the layers below never import it.
What it is not: the planner. It plans nothing and imports nothing above the core.
"""
from __future__ import annotations

from typing import Callable

_resolver: Callable | None = None


def set_resolver(fn: Callable | None) -> None:
    """Register fn(config, shape, hardware, model) -> a concrete OffloadConfig (None: unregister)."""
    global _resolver
    _resolver = fn


def resolved(config, shape=None, hardware=None, model=None):
    """config itself, or -- for a plan request (`config.auto`) -- the concrete config the registered planner picks."""
    if getattr(config, "auto", None) is None:
        return config
    if _resolver is None:
        raise ValueError(f"OffloadConfig {config.name!r} is a plan request (auto={config.auto!r}) and no planner is "
                         "registered: import fate_lab (the package root registers fate_lab.study.auto), or plan it "
                         "yourself with fate_lab.study.auto.plan_auto(calibration_trace, ...)")
    out = _resolver(config, shape, hardware, model)
    if getattr(out, "auto", None) is not None:
        raise RuntimeError(f"the planner returned another plan request for {config.name!r} (a planner bug)")
    return out
