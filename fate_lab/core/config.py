"""Configuration of the offloaded runtime: `OffloadConfig` (frozen) and its presets by name.

What this file is: every knob of `offload(model, config)` with a comment on why it exists, and
the named baselines the notebooks and benchmarks compare (`OffloadConfig.preset(name)`).
What it is not: a driver; the runtime, the timed simulator and the replay all build what they run
from these objects through one driver core (`fate_lab/core/driver.py`).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass

from fate_lab.policy.rules import Percentile, SelectionRule


@dataclass(frozen=True)
class OffloadConfig:
    """Every knob of the runtime; `OffloadConfig.preset(name, **overrides)` for the baselines."""

    name: str = "custom"
    budget: int | None = None  # device bytes for dense + KV + buffers + expert cache ...
    slots: int | None = None  # ... or the expert cache size in slots; neither: every expert fits
    slots_per_layer: tuple[int, ...] | None = None  # ... or exactly these cache slots per MoE layer (the
    # allocation is then not consulted: sweeps and replays set it; None: the allocation splits the budget)
    link: str = "pcie3_x16"  # hardware.links.LINK_PROFILES key ("instant": transfers land inside submit),
    # or a hardware.setups.SETUPS key: that setup's link scaled to this machine's clock
    predictor: str | None = "cross_layer_gate"  # None | "cross_layer_gate" | "activation_path" | "learned_gate"
    # | "activation_matrix" (MoE-Infinity's request-level activation matrices, the "eap" preset)
    activation_collection: tuple | None = None  # predictor="activation_matrix": profiled matrices [C][L][E] (counts,
    # `predictors.activation_matrices` of a calibration trace); None: collected online as prompts finish
    probes: str | None = None  # predictor="learned_gate": the model folder keeping probes.safetensors
    # (python -m fate_lab.policy.probes --fit); None: the folder of the model being run
    rule: SelectionRule | None = Percentile(75.0)  # cross-layer gate rule; None: TopK(model top_k)
    allocation: str = "shallow"  # allocation.ALLOCATIONS key
    miss_curves: tuple | None = None  # allocation="miss_curve": curves[l][c] misses of layer l with c slots;
    # None: calibrated at offload time on a short greedy run from a seeded prompt (LRU curves)
    shallow_layers: int | None = None  # Fate's L for allocation="shallow"; None: 1/8 of the MoE layers
    # (the paper uses L = 3-4 of Qwen1.5-MoE's 24 layers), at least 1
    replacement: str = "arc"  # registry.POLICIES key
    cache: bool = True  # False: nothing stays on the device after use (load on demand)
    all_resident: bool = False  # upper bound: every expert gets a slot, loaded before the first token;
    # budget/slots are then ignored
    popularity_order: bool = True  # prefill computes popular experts first
    prefetch_buffer_experts: int | None = None  # slots of each of the two prefetch pools; None: top_k
    # if prefetching (the planner counts top_k demand slots + 2 pools)
    prefetch_budget: str = "link"  # "link": queue only what the link can start before the next layer
    # needs it (its window minus the queue already waiting); "all": the whole predicted set
    prefetch_window: float = 1.0  # prefetch_budget="link": how many layer times ahead a transfer may
    # still start (1: before the next layer; 2: also during it, landing for a later token's reuse)
    admit_prefetch: str = "on_use"  # "on_use": a prefetched expert waits in staging and enters the
    # cache when used; "on_load": it is admitted into the cache when queued (may evict)
    prefetch_value: bool = False  # decode prefetches chosen, ordered and cancelled by expected stall saved against
    # the link time they take from demand loads; a used prefetch evicts only an expert used less
    # (policy/value_cache.py; prefill keeps the rule above). prefetch_budget/prefetch_window then do not apply
    prefetch_depth: int = 1  # prefetch_value: 2 also predicts layer m+2 from layer m's gate input (cross-layer gate)
    prefetch_low: bool = False  # prefetch_value with quant: a prefetch too late at its precision may travel at the
    # miss precision (Fate's INT2) when that saves more stall
    host_fill: bool = False  # host="cost": a decode miss computed on the host is also loaded in the background into
    # the cache (within one layer of link time, evicting only an expert used less); a needed prefetch not started
    # yet becomes a miss the host may take
    context_len: int = 512  # tokens of KV cache the budget must hold
    store: str = "ram"  # "ram" | "ssd" (read experts from `checkpoint` safetensors on demand)
    checkpoint: str | None = None  # safetensors file/folder for store="ssd"
    native_link: bool = False  # on CUDA: the real PCIe link instead of an emulated profile
    calibration_steps: int = 12  # decode steps timed to calibrate the scaled link
    layer_compute_s: float | None = None  # scaled link: the tiny model's layer time; None: calibrate now
    transfer_timeout_s: float = 60.0  # longest wait for one expert before a clear TransferError
    timeline: bool = True  # record (kind, layer, expert, t_start, t_end) events
    timeline_max_events: int = 200_000
    quant: str | None = None  # quant.QuantPolicy preset ("fate", "int8", "int4", ...); None: full precision
    host: str | None = None  # None: every expert computes on the device; "cost": a non-resident expert
    # computes on the host when that takes less than its transfer (Fiddler); "layers": the first
    # `host_layers` MoE layers' experts live and compute on the host (llama.cpp --n-cpu-moe)
    host_layers: int = 0  # host="layers": how many MoE layers, from the first; -1: all (kTransformers)
    lossy: str | None = None  # None: every expert computes as routed; "drop" | "substitute" | "commit":
    # what a decode step does with a miss (lossy.MissPolicy; the output changes, quality is measured)
    lossy_threshold: float = 0.1  # drop/substitute: a miss below this share of the token's top-k gate weight;
    # commit: the router is uncertain when its top-k hold less than this probability mass
    min_similarity: float | None = None  # substitute: no stand-in below this similarity (the miss is dropped)
    standin_window: int = 4  # standin: a miss recurring within this many decode calls of its layer after a
    # low-precision use is loaded at full precision; otherwise it computes from the resident INT2 copy
    similarity: str | None = None  # substitute: the model folder keeping expert_similarity.safetensors
    # (python -m fate_lab fit-similarity --model DIR); None: the folder of the model being run
    host_profile: str = "desktop_ddr4"  # host.HOST_PROFILES key: the CPU whose time a host call takes
    # (emulated on a CPU-only machine: the expert really computes, then the call holds for that time)
    auto: str | None = None  # a plan request ("auto" / "auto_quant" presets): "lossless" | "quant"; resolved into a
    # concrete config by the planner (fate_lab/study/auto.py) from a calibration trace before a driver builds it

    @staticmethod
    def preset_names(include_quant: bool = False, include_auto: bool = False) -> list[str]:
        """Names accepted by `preset`; the quantized and lossy ones (whose output differs) only with include_quant,
        the planned ones (`auto`, `auto_quant`: resolved from a calibration first) only with include_auto."""
        auto = [n for n, c in _AUTO_PRESETS.items() if include_quant or c.auto == "lossless"] if include_auto else []
        return list(_PRESETS) + (list(_QUANT_PRESETS) if include_quant else []) + auto

    @classmethod
    def preset(cls, name: str, **overrides) -> "OffloadConfig":
        """A named baseline with any field overridden (budget=..., slots=..., link=..., ...)."""
        known = {**_PRESETS, **_QUANT_PRESETS, **_AUTO_PRESETS}
        if name not in known:
            raise ValueError(f"unknown preset {_near(name, list(known))}; choose one of {list(known)}")
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise TypeError(f"OffloadConfig has no field {'; '.join(_near(k, fields) for k in unknown)}; its fields: "
                            f"{', '.join(fields)}")
        return dataclasses.replace(known[name], **overrides)

    def __post_init__(self) -> None:
        _check(self)


PREDICTORS = (None, "cross_layer_gate", "activation_path", "learned_gate", "activation_matrix")


def _near(word: str, names: list[str]) -> str:
    """word quoted, with the names it is probably a typo of ("'fat' (did you mean 'fate'?)")."""
    close = difflib.get_close_matches(str(word), names, n=2, cutoff=0.75)
    return f"{word!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else "")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check(c: OffloadConfig) -> None:
    """Every knob of a config, checked: the error names the field, the value, the unit and what is allowed."""
    from fate_lab.hardware.hosts import HOST_PROFILES
    from fate_lab.hardware.setups import link_names
    from fate_lab.policy.allocation import ALLOCATIONS
    from fate_lab.policy.lossy import LOSSY_KINDS
    from fate_lab.policy.registry import POLICIES
    from fate_lab.policy.rules import SelectionRule
    from fate_lab.quant import QuantPolicy

    def fail(field: str, what: str) -> None:
        raise ValueError(f"OffloadConfig.{field}={getattr(c, field)!r}: {what}")

    choices = {"prefetch_budget": ("link", "all"), "admit_prefetch": ("on_use", "on_load"), "store": ("ram", "ssd"),
               "host": (None, "cost", "layers"), "predictor": PREDICTORS, "lossy": (None, *LOSSY_KINDS),
               "allocation": tuple(ALLOCATIONS), "prefetch_depth": (1, 2), "auto": (None, "lossless", "quant")}
    for field, allowed in choices.items():
        if getattr(c, field) not in allowed:
            fail(field, f"choose one of {list(allowed)}")
    if c.link != "instant" and c.link not in link_names():
        fail("link", f"choose 'instant', a link ({', '.join(link_names())})")
    if not isinstance(c.replacement, str) or c.replacement.lower() not in POLICIES:
        fail("replacement", f"choose one of {sorted(POLICIES)}")
    for field in ("cache", "all_resident", "popularity_order", "native_link", "timeline", "prefetch_value",
                  "prefetch_low", "host_fill"):
        if not isinstance(getattr(c, field), bool):
            fail(field, "give True or False")
    for field, unit in (("budget", "bytes"), ("slots", "expert slots"), ("shallow_layers", "MoE layers"),
                        ("prefetch_buffer_experts", "experts in each of the two prefetch pools")):
        v = getattr(c, field)
        if v is not None and not (_is_int(v) and v >= 0):
            fail(field, f"give an int >= 0 ({unit}) or None")
    for field, lo, unit in (("context_len", 1, "tokens of KV cache"), ("calibration_steps", 2,
                            "decode steps timed (the median of fewer is noise)"), ("timeline_max_events", 0, "events"),
                            ("standin_window", 0, "decode calls")):
        v = getattr(c, field)
        if not (_is_int(v) and v >= lo):
            fail(field, f"give an int >= {lo} ({unit})")
    if c.slots_per_layer is not None:
        spl = c.slots_per_layer
        if not isinstance(spl, tuple) or not all(_is_int(v) and v >= 0 for v in spl):
            fail("slots_per_layer", "give a tuple of ints >= 0, one per MoE layer, or None")
        if c.budget is not None or c.slots is not None:
            raise ValueError("give the cache size once: budget=, slots= or slots_per_layer=")
    if not (_is_real(c.prefetch_window) and c.prefetch_window > 0):
        fail("prefetch_window", "give a finite number of layer times > 0")
    if not (_is_real(c.transfer_timeout_s) and c.transfer_timeout_s > 0):
        fail("transfer_timeout_s", "give a finite number of seconds > 0 (the hang guard cannot be switched off)")
    if c.layer_compute_s is not None and not (_is_real(c.layer_compute_s) and c.layer_compute_s > 0):
        fail("layer_compute_s", "give a finite number of seconds > 0, or None to calibrate")
    if not (_is_real(c.lossy_threshold) and 0.0 <= c.lossy_threshold <= 1.0):
        fail("lossy_threshold", "give a number in [0, 1] (a share of the gate weight, or of router mass)")
    if c.min_similarity is not None and not (_is_real(c.min_similarity) and -1.0 <= c.min_similarity <= 1.0):
        fail("min_similarity", "give a similarity in [-1, 1] or None")
    if c.rule is not None and not isinstance(c.rule, SelectionRule):
        fail("rule", "give a selection rule (e.g. Percentile(75.0), TopK(4)) or None")
    if c.host_profile not in HOST_PROFILES:
        fail("host_profile", f"choose one of {sorted(HOST_PROFILES)}")
    if not (_is_int(c.host_layers) and c.host_layers >= -1):
        fail("host_layers", "give a number of MoE layers, or -1 for all")
    if c.host == "layers" and c.host_layers == 0:
        raise ValueError("OffloadConfig(host='layers') needs host_layers > 0 (or -1: every layer)")
    if c.quant is not None:
        try:
            QuantPolicy.preset(c.quant)
        except ValueError as exc:
            raise ValueError(f"OffloadConfig.quant={c.quant!r}: {exc}") from None
    if c.lossy is not None and (c.host is not None or c.quant is not None):
        raise ValueError("a lossy miss policy runs alone: set host=None and quant=None with lossy=...")
    if c.host is not None and c.link == "disk":
        raise ValueError(f"OffloadConfig(host={c.host!r}, link='disk'): with the disk as the link the experts live on "
                         "disk, not in host RAM, so computing one on the host would first read it from the disk, the "
                         "link's own move; set host=None (a CPU-only machine has no other host to compute on)")
    if c.host is not None and c.quant is not None:
        raise ValueError("host compute runs full-precision experts; it cannot be combined with quant="
                         f"{c.quant!r} (choose one)")
    if c.prefetch_depth == 2 and not (c.prefetch_value and c.predictor == "cross_layer_gate"):
        raise ValueError("OffloadConfig(prefetch_depth=2) predicts two layers ahead with the cross-layer gate and is "
                         "planned by value: set predictor='cross_layer_gate' and prefetch_value=True")
    if c.prefetch_low and not (c.prefetch_value and c.quant is not None):
        raise ValueError("OffloadConfig(prefetch_low=True) lets a late prefetch travel at the miss precision: it needs "
                         "quant=... (e.g. 'fate') and prefetch_value=True")
    if c.host_fill and c.host != "cost":
        raise ValueError("OffloadConfig(host_fill=True) loads host-computed misses in the background: set host='cost'")
    if c.activation_collection is not None:
        m = c.activation_collection
        if c.predictor != "activation_matrix":
            raise ValueError("OffloadConfig.activation_collection is read by predictor='activation_matrix' only")
        if not (isinstance(m, tuple) and all(isinstance(x, tuple) and x and all(isinstance(r, tuple) for r in x)
                                             for x in m)):
            fail("activation_collection", "give a tuple of matrices, each a tuple of rows (tuples of counts), or None")
    if c.auto == "quant" and c.quant is None:
        raise ValueError("OffloadConfig(auto='quant') plans quantized configs: give quant=... (e.g. 'fate')")
    # store="ssd" without checkpoint= is valid here: load_offloaded fills it in; offload() refuses it without one


_PRESETS: dict[str, OffloadConfig] = {
    # upper bound: every expert has a slot and is loaded before the first token
    "all_resident": OffloadConfig("all_resident", predictor=None, allocation="uniform", replacement="lru",
                                  all_resident=True),
    # the paper's baseline: no cache, no prefetch; every use is a synchronous load
    "load_on_demand": OffloadConfig("load_on_demand", predictor=None, allocation="uniform", replacement="lru",
                                    cache=False, popularity_order=False),
    # plain offloading: on-demand loads kept in a per-layer LRU cache
    "lru": OffloadConfig("lru", predictor=None, allocation="uniform", replacement="lru"),
    # mixtral-offloading: LRU + next layer's router applied to this gate input, top-k speculative loads
    "mixtral_offloading": OffloadConfig("mixtral_offloading", predictor="cross_layer_gate", rule=None,
                                        allocation="uniform", replacement="lru", prefetch_budget="all",
                                        admit_prefetch="on_load"),
    # EAP baseline: expert-activation-path history predictor, LRU cache
    "activation_path": OffloadConfig("activation_path", predictor="activation_path", allocation="uniform",
                                     replacement="lru", prefetch_budget="all", admit_prefetch="on_load"),
    # EAP as MoE-Infinity traces it: request-level expert activation matrices matched against earlier requests
    # (docs/fate_vs_eap.md), with activation_path's cache and prefetch mechanics
    "eap": OffloadConfig("eap", predictor="activation_matrix", allocation="uniform", replacement="lru",
                         prefetch_budget="all", admit_prefetch="on_load"),
    # Fate: cross-layer gate + 75th-percentile expansion, shallow-favoring allocation, ARC; prefetches
    # wait in staging and enter the cache on use, at most what the link can start within 4 layer times
    # (the variant the simulator's sweep over link speeds kept: benchmarks/results/prefetch_variants_*.md)
    "fate": OffloadConfig("fate", prefetch_window=4.0),
    # Fate as the first version ran it: the whole percentile set queued and admitted into the cache
    "fate_v1": OffloadConfig("fate_v1", prefetch_budget="all", admit_prefetch="on_load"),
    # Fate with the learned cross-layer probes (policy/probes.py, fitted by fit/probes.py) instead of the router
    # product + percentile
    "fate_learned": OffloadConfig("fate_learned", prefetch_window=4.0, predictor="learned_gate"),
    # Fate + misses computed on the host CPU when that beats their transfer (Fiddler's cost model)
    "host_compute": OffloadConfig("host_compute", prefetch_window=4.0, host="cost"),
    # Fate with the first 2 MoE layers' experts living and computing on the host (llama.cpp --n-cpu-moe 2)
    "static_host": OffloadConfig("static_host", prefetch_window=4.0, host="layers", host_layers=2),
    # every routed expert on the host, attention and shared experts on the device (kTransformers)
    "all_host": OffloadConfig("all_host", predictor=None, allocation="uniform", replacement="lru", host="layers",
                              host_layers=-1),
}

# Presets whose output differs from the full-precision model's (`preset_names()` lists them apart):
# quantized ones (the same runtime policies as `fate`, experts stored and moved packed) and lossy ones.
_QUANT_PRESETS: dict[str, OffloadConfig] = {
    # Fate's scheme: INT4 cache/prefetch, INT2 misses and least popular prefill experts
    "fate_quant": dataclasses.replace(_PRESETS["fate"], name="fate_quant", quant="fate"),
    # every expert at INT8 (g64): the near-lossless check
    "fate_int8": dataclasses.replace(_PRESETS["fate"], name="fate_int8", quant="int8"),
    # plain LRU offloading with fate_quant's precisions (INT4 cached, INT2 misses): equal bytes
    "lru_quant": dataclasses.replace(_PRESETS["lru"], name="lru_quant", quant="fate"),
    # lossy decode steps on fate's pipeline (policy/lossy.py); thresholds from benchmarks/bench_lossy.py
    "drop_low": dataclasses.replace(_PRESETS["fate"], name="drop_low", lossy="drop", lossy_threshold=0.1),
    "substitute": dataclasses.replace(_PRESETS["fate"], name="substitute", lossy="substitute", lossy_threshold=0.1),
    "commit": dataclasses.replace(_PRESETS["fate"], name="commit", lossy="commit", lossy_threshold=0.5),
    # HOBBIT: an INT2 copy of every expert resident (its bytes come off the cache budget); misses compute
    # from it, experts that recur within 4 decode calls load at full precision
    "standin": dataclasses.replace(_PRESETS["fate"], name="standin", lossy="standin", standin_window=4),
}

# Plan requests: the planner (fate_lab/study/auto.py) picks allocation, replacement, prediction, host placement
# and precision per model, setup and budget from a calibration trace; `offload` and `simulate` resolve them.
_AUTO_PRESETS: dict[str, OffloadConfig] = {
    "auto": OffloadConfig("auto", auto="lossless"),  # lossless: exact tokens
    "auto_quant": OffloadConfig("auto_quant", auto="quant", quant="fate"),  # quantized: Fate's precisions or higher
}
