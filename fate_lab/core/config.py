"""Configuration of the offloaded runtime: `OffloadConfig` (frozen, composed of parts) and its presets by name.

What this file is: `OffloadConfig`, built from the parts of `config_parts.py` (where every knob is, with a comment
on why it exists) or from flat keywords, the rules between parts, and the named baselines the notebooks and
benchmarks compare (`OffloadConfig.preset(name)`), each a composition of shared parts.
What it is not: a driver; the runtime, the timed simulator and the replay all build what they run
from these objects through one driver core (`fate_lab/core/driver.py`).
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from fate_lab.core.config_parts import (  # noqa: F401
    FLAT,
    PARTS,
    PREDICTORS,
    CacheConfig,
    LinkConfig,
    LossyConfig,
    PlacementConfig,
    PrecisionConfig,
    PrefetchConfig,
    StoreConfig,
    TimelineConfig,
    ValuePrefetch,
)

_UNSET = object()  # a part not given (None is a value: lossy=None)
_SHORT = ("cache", "link", "store", "lossy", "timeline")  # parts also given as their main value, under their own name
# as a flat keyword (cache=False, link="disk", store="ssd", lossy="drop", timeline=False)


@dataclass(frozen=True, init=False)
class OffloadConfig:
    """Every knob of the runtime, in parts; `OffloadConfig.preset(name, **overrides)` for the baselines.

    Built from parts (``OffloadConfig("mine", cache=CacheConfig(slots=8, replacement="lru"),
    prefetch=PrefetchConfig(predictor=None))``), from flat keywords (``OffloadConfig("mine", slots=8,
    replacement="lru", predictor=None)``; `config_parts.FLAT` says which part field each sets), or both. A part may
    be given as its main value: ``link="disk"``, ``store="ssd"``, ``cache=False``, ``lossy="drop"``,
    ``timeline=False``. ``config.replace(**changes)`` takes the same keywords; every flat keyword also reads back
    (``config.prefetch_window`` is ``config.prefetch.window``), except those five, which are the parts themselves.
    """

    name: str
    cache: CacheConfig
    prefetch: PrefetchConfig
    placement: PlacementConfig
    precision: PrecisionConfig
    lossy: LossyConfig
    link: LinkConfig
    store: StoreConfig
    timeline: TimelineConfig
    auto: str | None  # a plan request ("auto" / "auto_quant" presets): "lossless" | "quant"; resolved into a
    # concrete config by the planner (fate_lab/study/auto.py) from a calibration trace before a driver builds it

    def __init__(self, name: str = "custom", *, cache=_UNSET, prefetch=_UNSET, placement=_UNSET, precision=_UNSET,
                 lossy=_UNSET, link=_UNSET, store=_UNSET, timeline=_UNSET, auto: str | None = None, **flat):
        given = {"cache": cache, "prefetch": prefetch, "placement": placement, "precision": precision, "lossy": lossy,
                 "link": link, "store": store, "timeline": timeline}
        objects = {p for p, v in given.items() if isinstance(v, PARTS[p])}
        for p, v in given.items():
            if v is _UNSET or p in objects:
                continue
            if p not in _SHORT:
                raise TypeError(f"OffloadConfig({p}={v!r}): give a {PARTS[p].__name__}")
            if len(objects) == len(PARTS) - 1:  # dataclasses.replace(config, link=...) passes every other part
                raise TypeError(f"setting the {p!r} part from {v!r} would reset its other fields: use "
                                f"config.replace({p}={v!r}) instead of dataclasses.replace")
            flat[p] = v
        parts = {p: given[p] if p in objects else PARTS[p]() for p in PARTS}
        for p, fields in _by_part(flat, parts["prefetch"]).items():
            parts[p] = dataclasses.replace(parts[p], **fields)
        if not isinstance(name, str):
            raise TypeError(f"OffloadConfig name={name!r}: give a str")
        object.__setattr__(self, "name", name)
        for p, v in parts.items():
            object.__setattr__(self, p, v)
        object.__setattr__(self, "auto", auto)
        _check(self)

    def replace(self, **changes) -> "OffloadConfig":
        """This config with parts or flat keywords changed (``config.replace(link="disk", slots=8)``); a part's
        main value (``link="disk"``) changes that field of this config's part, keeping the rest of it."""
        kw = {p: getattr(self, p) for p in PARTS}
        for p in PARTS:
            if p in changes:
                v = changes.pop(p)
                if isinstance(v, PARTS[p]) or p not in _SHORT:
                    kw[p] = v  # a wrong type is refused by the constructor
                else:
                    kw[p] = dataclasses.replace(kw[p], **{FLAT[p][1]: v})
        return OffloadConfig(changes.pop("name", self.name), auto=changes.pop("auto", self.auto), **kw, **changes)

    @staticmethod
    def preset_names(include_quant: bool = False, include_auto: bool = False) -> list[str]:
        """Names accepted by `preset`; the quantized and lossy ones (whose output differs) only with include_quant,
        the planned ones (`auto`, `auto_quant`: resolved from a calibration first) only with include_auto."""
        auto = [n for n, c in _AUTO_PRESETS.items() if include_quant or c.auto == "lossless"] if include_auto else []
        return list(_PRESETS) + (list(_QUANT_PRESETS) if include_quant else []) + auto

    @classmethod
    def preset(cls, name: str, **overrides) -> "OffloadConfig":
        """A named baseline with any part or flat keyword overridden (budget=..., slots=..., link=..., ...)."""
        known = {**_PRESETS, **_QUANT_PRESETS, **_AUTO_PRESETS}
        if name not in known:
            raise ValueError(f"unknown preset {_near(name, list(known))}; choose one of {list(known)}")
        return known[name].replace(**overrides)


def _by_part(flat: dict, prefetch: PrefetchConfig) -> dict[str, dict]:
    """Flat keywords grouped into each part's field changes; the value-prefetch knobs folded into prefetch.value.
    An unknown keyword is one TypeError naming the part it belongs to, or what it was probably meant to be."""
    out: dict[str, dict] = {}
    value, sub = prefetch.value, {}
    for k, v in flat.items():
        path = FLAT.get(k)
        if path is None:
            raise TypeError(_unknown(k))
        if path == ("prefetch", "value"):
            if not isinstance(v, bool):
                raise ValueError(f"OffloadConfig.prefetch_value={v!r}: give True or False [prefetch.value]")
            value = (value if value is not None else ValuePrefetch()) if v else None
        elif len(path) == 3:
            sub[path[2]] = v
        else:
            out.setdefault(path[0], {})[path[1]] = v
    if sub:
        asked = ValuePrefetch(**sub)  # checked on its own first: a bad depth says so
        if value is None:
            if asked != ValuePrefetch():
                k = next(f for f in sub if getattr(asked, f) != getattr(ValuePrefetch(), f))
                raise ValueError(f"OffloadConfig.{_flat_of('prefetch.value', k)}={sub[k]!r} is a knob of the value "
                                 f"prefetch (prefetch.value.{k}): set prefetch_value=True")
        else:
            value = dataclasses.replace(value, **sub)
    if value is not prefetch.value:
        out.setdefault("prefetch", {})["value"] = value
    return out


def _unknown(k: str) -> str:
    """The error for a keyword OffloadConfig does not take: the part whose field it names, or the near misses."""
    owners = [(p, f.name) for p, cls in PARTS.items() for f in dataclasses.fields(cls) if f.name == k]
    owners += [("prefetch.value", f.name) for f in dataclasses.fields(ValuePrefetch) if f.name == k]
    by_part = "; ".join(f"{p}: {', '.join(n for n, path in FLAT.items() if path[0] == p)}" for p in PARTS)
    if owners:
        hint = " or ".join(f"{_flat_of(p, f)}= (the {p} part's {f!r})" for p, f in owners)
        return f"OffloadConfig has no keyword {k!r}: give {hint}, or the part itself"
    return f"OffloadConfig has no field {_near(k, list(FLAT) + ['name', 'auto'])}; its keywords by part: {by_part}"


def _flat_of(part: str, field: str) -> str:
    path = tuple(part.split(".")) + (field,)
    return next(n for n, p in FLAT.items() if p == path)


def _alias(flat: str, path: tuple[str, ...]) -> property:
    """The read-only flat name of a part's field (``config.prefetch_window`` -> ``config.prefetch.window``)."""
    if path == ("prefetch", "value"):
        return property(lambda self: self.prefetch.value is not None, doc="prefetch.value is not None")
    if len(path) == 3:
        default = getattr(ValuePrefetch(), path[2])
        return property(lambda self: default if self.prefetch.value is None else getattr(self.prefetch.value, path[2]),
                        doc=f"prefetch.value.{path[2]} ({default!r} without value prefetch)")
    return property(lambda self: getattr(getattr(self, path[0]), path[1]), doc=".".join(path))


for _flat, _path in FLAT.items():
    if _flat not in PARTS:
        setattr(OffloadConfig, _flat, _alias(_flat, _path))


def _near(word: str, names: list[str]) -> str:
    """word quoted, with the names it is probably a typo of ("'fat' (did you mean 'fate'?)")."""
    close = difflib.get_close_matches(str(word), names, n=2, cutoff=0.75)
    return f"{word!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else "")


def refuse_plan_request(config: OffloadConfig, where: str) -> None:
    """A plan request (`auto`, `auto_quant`) stops here: the planner sits above the drivers and is called
    explicitly -- by `fate_lab.offload` / `fate_lab.simulate`, or by the caller (`fate_lab.study.auto.resolve`)."""
    if config.auto is not None:
        raise ValueError(f"OffloadConfig {config.name!r} is a plan request (auto={config.auto!r}) and {where} does not "
                         "plan: call fate_lab.offload(model, config) or fate_lab.simulate(trace, config, hardware, "
                         "shape), which plan it first, or plan it yourself with fate_lab.study.auto.resolve(config, "
                         "...) or plan_auto(calibration_trace, ...)")


def _check(c: OffloadConfig) -> None:
    """The rules between parts (each part checks itself): the error says what to change."""
    if c.auto not in (None, "lossless", "quant"):
        raise ValueError(f"OffloadConfig.auto={c.auto!r}: choose one of [None, 'lossless', 'quant']")
    host, quant = c.placement.host, c.precision.quant
    if c.lossy.kind is not None and (host is not None or quant is not None):
        raise ValueError("a lossy miss policy runs alone: set host=None and quant=None with lossy=...")
    if host is not None and c.link.name == "disk":
        raise ValueError(f"OffloadConfig(host={host!r}, link='disk'): with the disk as the link the experts live on "
                         "disk, not in host RAM, so computing one on the host would first read it from the disk, the "
                         "link's own move; set host=None (a CPU-only machine has no other host to compute on)")
    if host is not None and quant is not None:
        raise ValueError(f"host compute runs full-precision experts; it cannot be combined with quant={quant!r} "
                         "(choose one)")
    if c.prefetch.value is not None and c.prefetch.value.low and quant is None:
        raise ValueError("OffloadConfig(prefetch_low=True) lets a late prefetch travel at the miss precision: it needs "
                         "quant=... (e.g. 'fate') and prefetch_value=True")
    if c.auto == "quant" and quant is None:
        raise ValueError("OffloadConfig(auto='quant') plans quantized configs: give quant=... (e.g. 'fate')")


# The parts the presets share.
_LRU = CacheConfig(allocation="uniform", replacement="lru")  # plain offloading's cache: even split, LRU
_NO_PREFETCH = PrefetchConfig(predictor=None)
_QUEUE_ALL = dict(budget="all", admit="on_load")  # the whole predicted set queued, admitted into the cache
_FATE_PREFETCH = PrefetchConfig(window=4.0)  # at most what the link can start within 4 layer times

_PRESETS: dict[str, OffloadConfig] = {
    # upper bound: every expert has a slot and is loaded before the first token
    "all_resident": OffloadConfig("all_resident", cache=dataclasses.replace(_LRU, all_resident=True),
                                  prefetch=_NO_PREFETCH),
    # the paper's baseline: no cache, no prefetch; every use is a synchronous load
    "load_on_demand": OffloadConfig("load_on_demand", cache=dataclasses.replace(_LRU, keep=False,
                                                                                popularity_order=False),
                                    prefetch=_NO_PREFETCH),
    # plain offloading: on-demand loads kept in a per-layer LRU cache
    "lru": OffloadConfig("lru", cache=_LRU, prefetch=_NO_PREFETCH),
    # mixtral-offloading: LRU + next layer's router applied to this gate input, top-k speculative loads
    "mixtral_offloading": OffloadConfig("mixtral_offloading", cache=_LRU, prefetch=PrefetchConfig(rule=None,
                                                                                                  **_QUEUE_ALL)),
    # EAP baseline: expert-activation-path history predictor, LRU cache
    "activation_path": OffloadConfig("activation_path", cache=_LRU,
                                     prefetch=PrefetchConfig(predictor="activation_path", **_QUEUE_ALL)),
    # EAP as MoE-Infinity traces it: request-level expert activation matrices matched against earlier requests
    # (docs/fate_vs_eap.md), with activation_path's cache and prefetch mechanics
    "eap": OffloadConfig("eap", cache=_LRU, prefetch=PrefetchConfig(predictor="activation_matrix", **_QUEUE_ALL)),
    # Fate: cross-layer gate + 75th-percentile expansion, shallow-favoring allocation, ARC; prefetches
    # wait in staging and enter the cache on use, at most what the link can start within 4 layer times
    # (the variant the simulator's sweep over link speeds kept: benchmarks/results/prefetch_variants_*.md)
    "fate": OffloadConfig("fate", prefetch=_FATE_PREFETCH),
    # Fate as the first version ran it: the whole percentile set queued and admitted into the cache
    "fate_v1": OffloadConfig("fate_v1", prefetch=PrefetchConfig(**_QUEUE_ALL)),
    # Fate with the learned cross-layer probes (policy/probes.py, fitted by fit/probes.py) instead of the router
    # product + percentile
    "fate_learned": OffloadConfig("fate_learned", prefetch=dataclasses.replace(_FATE_PREFETCH,
                                                                               predictor="learned_gate")),
    # Fate + misses computed on the host CPU when that beats their transfer (Fiddler's cost model)
    "host_compute": OffloadConfig("host_compute", prefetch=_FATE_PREFETCH, placement=PlacementConfig(host="cost")),
    # Fate with the first 2 MoE layers' experts living and computing on the host (llama.cpp --n-cpu-moe 2)
    "static_host": OffloadConfig("static_host", prefetch=_FATE_PREFETCH,
                                 placement=PlacementConfig(host="layers", layers=2)),
    # every routed expert on the host, attention and shared experts on the device (kTransformers)
    "all_host": OffloadConfig("all_host", cache=_LRU, prefetch=_NO_PREFETCH,
                              placement=PlacementConfig(host="layers", layers=-1)),
}

# Presets whose output differs from the full-precision model's (`preset_names()` lists them apart):
# quantized ones (the same runtime policies as `fate`, experts stored and moved packed) and lossy ones.
_FATE_INT4_INT2 = PrecisionConfig(quant="fate")
_QUANT_PRESETS: dict[str, OffloadConfig] = {
    # Fate's scheme: INT4 cache/prefetch, INT2 misses and least popular prefill experts
    "fate_quant": _PRESETS["fate"].replace(name="fate_quant", precision=_FATE_INT4_INT2),
    # every expert at INT8 (g64): the near-lossless check
    "fate_int8": _PRESETS["fate"].replace(name="fate_int8", precision=PrecisionConfig(quant="int8")),
    # plain LRU offloading with fate_quant's precisions (INT4 cached, INT2 misses): equal bytes
    "lru_quant": _PRESETS["lru"].replace(name="lru_quant", precision=_FATE_INT4_INT2),
    # lossy decode steps on fate's pipeline (policy/lossy.py); thresholds from benchmarks/bench_lossy.py
    "drop_low": _PRESETS["fate"].replace(name="drop_low", lossy=LossyConfig("drop", threshold=0.1)),
    "substitute": _PRESETS["fate"].replace(name="substitute", lossy=LossyConfig("substitute", threshold=0.1)),
    "commit": _PRESETS["fate"].replace(name="commit", lossy=LossyConfig("commit", threshold=0.5)),
    # HOBBIT: an INT2 copy of every expert resident (its bytes come off the cache budget); misses compute
    # from it, experts that recur within 4 decode calls load at full precision
    "standin": _PRESETS["fate"].replace(name="standin", lossy=LossyConfig("standin", standin_window=4)),
}

# Plan requests: the planner (fate_lab/study/auto.py) picks allocation, replacement, prediction, host placement
# and precision per model, setup and budget from a calibration trace; `offload` and `simulate` resolve them.
_AUTO_PRESETS: dict[str, OffloadConfig] = {
    "auto": OffloadConfig("auto", auto="lossless"),  # lossless: exact tokens
    "auto_quant": OffloadConfig("auto_quant", auto="quant", precision=_FATE_INT4_INT2),  # Fate's precisions or higher
}
