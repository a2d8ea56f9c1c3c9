"""The parts an `OffloadConfig` is composed of: each a small frozen dataclass that checks itself.

What this file is: the eight parts (cache, prefetch with its optional value prefetch, placement, precision,
lossy, link, store, timeline), the one table `FLAT` that maps every flat keyword (``prefetch_window=4``,
``link="disk"``) to the part field it sets, and the checks that need nothing outside their own part.
A "needs" rule is structure where it can be: the value-prefetch knobs (depth, low) live inside
`ValuePrefetch`, which exists only when value prefetch is on. Rules between parts (a lossy policy runs
alone, host compute and quantization exclude each other, ...) are `config.py`'s.
What it is not: the presets or the flat keywords' parsing (`config.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from fate_lab.policy.rules import Percentile, SelectionRule

# flat keyword -> (part, field[, field of the nested part]); the one list of every knob. A part's fields'
# order here is its fields' order.
FLAT: dict[str, tuple[str, ...]] = {
    "budget": ("cache", "budget"), "slots": ("cache", "slots"), "slots_per_layer": ("cache", "slots_per_layer"),
    "context_len": ("cache", "context_len"), "allocation": ("cache", "allocation"),
    "shallow_layers": ("cache", "shallow_layers"), "miss_curves": ("cache", "miss_curves"),
    "replacement": ("cache", "replacement"), "cache": ("cache", "keep"), "all_resident": ("cache", "all_resident"),
    "popularity_order": ("cache", "popularity_order"),
    "predictor": ("prefetch", "predictor"), "rule": ("prefetch", "rule"),
    "activation_collection": ("prefetch", "activation_collection"), "probes": ("prefetch", "probes"),
    "prefetch_buffer_experts": ("prefetch", "buffer_experts"), "prefetch_budget": ("prefetch", "budget"),
    "prefetch_window": ("prefetch", "window"), "admit_prefetch": ("prefetch", "admit"),
    "prefetch_value": ("prefetch", "value"), "prefetch_depth": ("prefetch", "value", "depth"),
    "prefetch_low": ("prefetch", "value", "low"),
    "host": ("placement", "host"), "host_layers": ("placement", "layers"), "host_profile": ("placement", "profile"),
    "host_fill": ("placement", "fill"),
    "quant": ("precision", "quant"),
    "lossy": ("lossy", "kind"), "lossy_threshold": ("lossy", "threshold"),
    "min_similarity": ("lossy", "min_similarity"), "standin_window": ("lossy", "standin_window"),
    "similarity": ("lossy", "similarity"),
    "link": ("link", "name"), "native_link": ("link", "native"), "calibration_steps": ("link", "calibration_steps"),
    "layer_compute_s": ("link", "layer_compute_s"), "transfer_timeout_s": ("link", "transfer_timeout_s"),
    "store": ("store", "kind"), "checkpoint": ("store", "checkpoint"), "direct_reads": ("store", "direct"),
    "timeline": ("timeline", "on"), "timeline_max_events": ("timeline", "max_events"),
}
_FLAT_OF = {path: flat for flat, path in FLAT.items()}  # (part, field[, sub]) -> the flat keyword
PREDICTORS = (None, "cross_layer_gate", "activation_path", "learned_gate", "activation_matrix")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _fail(part, path: tuple[str, ...], what: str):
    """The error of one bad field, named both ways: ``OffloadConfig.prefetch_window=inf: ... [prefetch.window]``."""
    value = getattr(part, path[-1])
    flat = _FLAT_OF.get(path)
    raise ValueError(f"OffloadConfig.{flat or '.'.join(path)}={value!r}: {what}"
                     f"{' [' + '.'.join(path) + ']' if flat else ''}")


def _part(name: str):
    """A frozen dataclass registered as the part ``name``, which has no truth value and refuses to equal a plain
    value: ``config.link == "disk"`` is a TypeError (compare ``config.link.name``), not a silent False."""
    def wrap(cls):
        cls = dataclass(frozen=True)(cls)
        eq = cls.__eq__

        def __eq__(self, other):
            if other is None or isinstance(other, (str, bool, int, float)):
                raise TypeError(f"{cls.__name__} is the config's {name!r} part, not a value: compare one of its "
                                f"fields ({', '.join(f.name for f in fields(cls))}) with {other!r}")
            return eq(self, other)

        def __bool__(self):
            raise TypeError(f"{cls.__name__} (the config's {name!r} part) has no truth value: test one of its "
                            f"fields ({', '.join(f.name for f in fields(cls))})")
        cls.__eq__, cls.__bool__, cls.PART = __eq__, __bool__, name
        return cls
    return wrap


def _choose(part, path, allowed) -> None:
    if getattr(part, path[-1]) not in allowed:
        _fail(part, path, f"choose one of {list(allowed)}")


def _flag(part, path) -> None:
    if not isinstance(getattr(part, path[-1]), bool):
        _fail(part, path, "give True or False")


def _count(part, path, unit: str, lo: int = 0, optional: bool = False) -> None:
    v = getattr(part, path[-1])
    if not ((optional and v is None) or (is_int(v) and v >= lo)):
        _fail(part, path, f"give an int >= {lo} ({unit})" + (" or None" if optional else ""))


@_part("cache")
class CacheConfig:
    """How many slots, split how between the MoE layers, kept by which replacement policy."""

    budget: int | None = None  # device bytes for dense + KV + buffers + expert cache ...
    slots: int | None = None  # ... or the expert cache size in slots; neither: every expert fits
    slots_per_layer: tuple[int, ...] | None = None  # ... or exactly these slots per MoE layer (the allocation is
    # then not consulted: sweeps and replays set it; None: the allocation splits the budget)
    context_len: int = 512  # tokens of KV cache the budget must hold
    allocation: str = "shallow"  # allocation.ALLOCATIONS key
    shallow_layers: int | None = None  # Fate's L for allocation="shallow"; None: 1/8 of the MoE layers
    # (the paper uses L = 3-4 of Qwen1.5-MoE's 24 layers), at least 1
    miss_curves: tuple | None = None  # allocation="miss_curve": curves[l][c] misses of layer l with c slots;
    # None: calibrated at offload time on a short greedy run from a seeded prompt (LRU curves)
    replacement: str = "arc"  # registry.POLICIES key
    keep: bool = True  # False: nothing stays on the device after use (load on demand)
    all_resident: bool = False  # upper bound: every expert gets a slot, loaded before the first token;
    # budget/slots are then ignored
    popularity_order: bool = True  # prefill computes popular experts first

    def __post_init__(self) -> None:
        from fate_lab.policy.allocation import ALLOCATIONS
        from fate_lab.policy.registry import POLICIES

        _choose(self, ("cache", "allocation"), tuple(ALLOCATIONS))
        if not isinstance(self.replacement, str) or self.replacement.lower() not in POLICIES:
            _fail(self, ("cache", "replacement"), f"choose one of {sorted(POLICIES)}")
        for f in ("keep", "all_resident", "popularity_order"):
            _flag(self, ("cache", f))
        _count(self, ("cache", "budget"), "bytes", optional=True)
        _count(self, ("cache", "slots"), "expert slots", optional=True)
        _count(self, ("cache", "shallow_layers"), "MoE layers", optional=True)
        _count(self, ("cache", "context_len"), "tokens of KV cache", lo=1)
        if self.slots_per_layer is not None:
            spl = self.slots_per_layer
            if not isinstance(spl, tuple) or not all(is_int(v) and v >= 0 for v in spl):
                _fail(self, ("cache", "slots_per_layer"), "give a tuple of ints >= 0, one per MoE layer, or None")
            if self.budget is not None or self.slots is not None:
                raise ValueError("give the cache size once: budget=, slots= or slots_per_layer=")


@_part("value")
class ValuePrefetch:
    """Decode prefetches chosen, ordered and cancelled by the expected stall they save against the link time they
    take from demand loads; a used prefetch evicts only an expert used less (policy/value_cache.py). Present in
    `PrefetchConfig.value` only when on, so its knobs cannot be set without it."""

    depth: int = 1  # 2: also predicts layer m+2 from layer m's gate input (cross-layer gate)
    low: bool = False  # with quant: a prefetch too late at its precision may travel at the miss precision (Fate's
    # INT2) when that saves more stall

    def __post_init__(self) -> None:
        _choose(self, ("prefetch", "value", "depth"), (1, 2))
        _flag(self, ("prefetch", "value", "low"))


@_part("prefetch")
class PrefetchConfig:
    """What is predicted for the next layers and how much of it is moved ahead of use."""

    predictor: str | None = "cross_layer_gate"  # None | "cross_layer_gate" | "activation_path" | "learned_gate"
    # | "activation_matrix" (MoE-Infinity's request-level activation matrices, the "eap" preset)
    rule: SelectionRule | None = Percentile(75.0)  # cross-layer gate rule; None: TopK(model top_k)
    activation_collection: tuple | None = None  # predictor="activation_matrix": profiled matrices [C][L][E] (counts,
    # `predictors.activation_matrices` of a calibration trace); None: collected online as prompts finish
    probes: str | None = None  # predictor="learned_gate": the model folder keeping probes.safetensors
    # (python -m fate_lab.policy.probes --fit); None: the folder of the model being run
    buffer_experts: int | None = None  # slots of each of the two prefetch pools; None: top_k if prefetching
    budget: str = "link"  # "link": queue only what the link can start before the next layer needs it (its window
    # minus the queue already waiting); "all": the whole predicted set
    window: float = 1.0  # budget="link": how many layer times ahead a transfer may still start (1: before the next
    # layer; 2: also during it, landing for a later token's reuse)
    admit: str = "on_use"  # "on_use": a prefetched expert waits in staging and enters the cache when used;
    # "on_load": it is admitted into the cache when queued (may evict)
    value: ValuePrefetch | None = None  # decode prefetch planned by value (budget/window then do not apply to
    # decode; prefill keeps them); None: the rule above

    def __post_init__(self) -> None:
        _choose(self, ("prefetch", "predictor"), PREDICTORS)
        _choose(self, ("prefetch", "budget"), ("link", "all"))
        _choose(self, ("prefetch", "admit"), ("on_use", "on_load"))
        _count(self, ("prefetch", "buffer_experts"), "experts in each of the two prefetch pools", optional=True)
        if not (is_real(self.window) and self.window > 0):
            _fail(self, ("prefetch", "window"), "give a finite number of layer times > 0")
        if self.rule is not None and not isinstance(self.rule, SelectionRule):
            _fail(self, ("prefetch", "rule"), "give a selection rule (e.g. Percentile(75.0), TopK(4)) or None")
        if self.value is not None and not isinstance(self.value, ValuePrefetch):
            _fail(self, ("prefetch", "value"), "give a ValuePrefetch(depth=..., low=...) or None")
        if self.value is not None and self.value.depth == 2 and self.predictor != "cross_layer_gate":
            raise ValueError("OffloadConfig(prefetch_depth=2) predicts two layers ahead with the cross-layer gate and "
                             "is planned by value: set predictor='cross_layer_gate' and prefetch_value=True")
        m = self.activation_collection
        if m is not None:
            if self.predictor != "activation_matrix":
                raise ValueError("OffloadConfig.activation_collection is read by predictor='activation_matrix' only")
            if not (isinstance(m, tuple) and all(isinstance(x, tuple) and x and all(isinstance(r, tuple) for r in x)
                                                 for x in m)):
                _fail(self, ("prefetch", "activation_collection"),
                      "give a tuple of matrices, each a tuple of rows (tuples of counts), or None")


@_part("placement")
class PlacementConfig:
    """Where an expert computes: on the device, or on the host CPU (per miss by cost, or whole layers)."""

    host: str | None = None  # None: every expert computes on the device; "cost": a non-resident expert computes on
    # the host when that takes less than its transfer (Fiddler); "layers": the first `layers` MoE layers' experts
    # live and compute on the host (llama.cpp --n-cpu-moe)
    layers: int = 0  # host="layers": how many MoE layers, from the first; -1: all (kTransformers)
    profile: str = "desktop_ddr4"  # host.HOST_PROFILES key: the CPU whose time a host call takes (emulated on a
    # CPU-only machine: the expert really computes, then the call holds for that time)
    fill: bool = False  # host="cost": a decode miss computed on the host is also loaded in the background into the
    # cache (within one layer of link time, evicting only an expert used less); a needed prefetch not started yet
    # becomes a miss the host may take

    def __post_init__(self) -> None:
        from fate_lab.hardware.hosts import HOST_PROFILES

        _choose(self, ("placement", "host"), (None, "cost", "layers"))
        _choose(self, ("placement", "profile"), sorted(HOST_PROFILES))
        _flag(self, ("placement", "fill"))
        if not (is_int(self.layers) and self.layers >= -1):
            _fail(self, ("placement", "layers"), "give a number of MoE layers, or -1 for all")
        if self.host == "layers" and self.layers == 0:
            raise ValueError("OffloadConfig(host='layers') needs host_layers > 0 (or -1: every layer)")
        if self.fill and self.host != "cost":
            raise ValueError("OffloadConfig(host_fill=True) loads host-computed misses in the background: set "
                             "host='cost'")


@_part("precision")
class PrecisionConfig:
    """At which precision experts are stored, moved and computed."""

    quant: str | None = None  # quant.QuantPolicy preset ("fate", "int8", "int4", ...); None: full precision

    def __post_init__(self) -> None:
        from fate_lab.quant import QuantPolicy

        if self.quant is not None:
            try:
                QuantPolicy.preset(self.quant)
            except ValueError as exc:
                raise ValueError(f"OffloadConfig.quant={self.quant!r}: {exc}") from None


@_part("lossy")
class LossyConfig:
    """What a decode step does with a miss when the output may change (policy/lossy.py; quality is measured)."""

    kind: str | None = None  # None: every expert computes as routed; "drop" | "substitute" | "commit" | "standin"
    threshold: float = 0.1  # drop/substitute: a miss below this share of the token's top-k gate weight;
    # commit: the router is uncertain when its top-k hold less than this probability mass
    min_similarity: float | None = None  # substitute: no stand-in below this similarity (the miss is dropped)
    standin_window: int = 4  # standin: a miss recurring within this many decode calls of its layer after a
    # low-precision use is loaded at full precision; otherwise it computes from the resident INT2 copy
    similarity: str | None = None  # substitute: the model folder keeping expert_similarity.safetensors
    # (python -m fate_lab fit-similarity --model DIR); None: the folder of the model being run

    def __post_init__(self) -> None:
        from fate_lab.policy.lossy import LOSSY_KINDS

        _choose(self, ("lossy", "kind"), (None, *LOSSY_KINDS))
        if not (is_real(self.threshold) and 0.0 <= self.threshold <= 1.0):
            _fail(self, ("lossy", "threshold"), "give a number in [0, 1] (a share of the gate weight, or of router "
                                                "mass)")
        if self.min_similarity is not None and not (is_real(self.min_similarity) and -1 <= self.min_similarity <= 1):
            _fail(self, ("lossy", "min_similarity"), "give a similarity in [-1, 1] or None")
        _count(self, ("lossy", "standin_window"), "decode calls")


@_part("link")
class LinkConfig:
    """The link experts cross on their way to the device: which profile, and the runtime's guards on it."""

    name: str = "pcie3_x16"  # hardware.links.LINK_PROFILES key ("instant": transfers land inside submit; "disk":
    # reads from the checkpoint with O_DIRECT), or a hardware.setups.SETUPS key: that setup's link scaled to this
    # machine's clock
    native: bool = False  # on CUDA: the real PCIe link instead of an emulated profile
    calibration_steps: int = 12  # decode steps timed to calibrate the scaled link
    layer_compute_s: float | None = None  # scaled link: the tiny model's layer time; None: calibrate now
    transfer_timeout_s: float = 60.0  # longest wait for one expert before a clear TransferError

    def __post_init__(self) -> None:
        from fate_lab.hardware.setups import link_names

        if self.name != "instant" and self.name not in link_names():
            _fail(self, ("link", "name"), f"choose 'instant', a link ({', '.join(link_names())})")
        _flag(self, ("link", "native"))
        _count(self, ("link", "calibration_steps"), "decode steps timed (the median of fewer is noise)", lo=2)
        if not (is_real(self.transfer_timeout_s) and self.transfer_timeout_s > 0):
            _fail(self, ("link", "transfer_timeout_s"), "give a finite number of seconds > 0 (the hang guard cannot "
                                                         "be switched off)")
        if self.layer_compute_s is not None and not (is_real(self.layer_compute_s) and self.layer_compute_s > 0):
            _fail(self, ("link", "layer_compute_s"), "give a finite number of seconds > 0, or None to calibrate")


@_part("store")
class StoreConfig:
    """Where the host keeps the experts: in RAM, or read on demand from the checkpoint's safetensors."""

    kind: str = "ram"  # "ram" | "ssd"
    checkpoint: str | None = None  # safetensors file/folder for kind="ssd" (load_offloaded fills it in; offload()
    # refuses "ssd" without one)
    direct: bool = False  # link="disk": read each expert straight into its slot by its byte plan (offloading/
    # byte_plan.py), which frees the interpreter lock the compute thread needs: decode 1.2-1.4x faster on the 2-core
    # test machine (benchmarks/bench_disk_reader.py). Off by default: the simulator's disk model is calibrated on the
    # conversion path and does not predict these runs yet (docs/disk.md, "Reading straight into the slot")

    def __post_init__(self) -> None:
        _choose(self, ("store", "kind"), ("ram", "ssd"))
        _flag(self, ("store", "direct"))


@_part("timeline")
class TimelineConfig:
    """The runtime's event record: (kind, layer, expert, t_start, t_end) per transfer and compute."""

    on: bool = True
    max_events: int = 200_000

    def __post_init__(self) -> None:
        _flag(self, ("timeline", "on"))
        _count(self, ("timeline", "max_events"), "events")


PARTS = {"cache": CacheConfig, "prefetch": PrefetchConfig, "placement": PlacementConfig, "precision": PrecisionConfig,
         "lossy": LossyConfig, "link": LinkConfig, "store": StoreConfig, "timeline": TimelineConfig}
