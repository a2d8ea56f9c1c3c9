"""Which precision an expert rests or travels at: `QuantPolicy`, Fate's INT4 cache / INT2 miss scheme and presets.

What this file is: a frozen policy keyed by reason ("cache", "prefetch", "prefill_low", "miss") and by
MoE layer, the precisions the host store must keep, and how many prefill prefetches travel low.
What it is not: the kernels (`kernels.py`) or the stores and slots that hold the bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from fate_lab.quant.kernels import REASONS, QuantSpec


@dataclass(frozen=True)
class QuantPolicy:
    """Which precision an expert rests or travels at; None means full precision.

    Reasons: "cache" (held in the device cache), "prefetch" (predicted, sent ahead of use),
    "prefill_low" (the least popular predicted experts of a prefill), "miss" (loaded on demand).
    """

    cache: QuantSpec | None = None  # Fate: INT4 in the device cache
    prefetch: QuantSpec | None = None  # Fate: INT4, so a prefetched expert can stay cached
    prefill_low: QuantSpec | None = None  # Fate: INT2 for the least popular prefill experts
    prefill_low_share: float = 0.0  # share of predicted prefill experts sent at prefill_low
    miss: QuantSpec | None = None  # Fate: INT2 for mispredicted, on-demand experts
    layer_overrides: tuple[tuple[int, QuantSpec | None], ...] = field(default=())  # (MoE layer, spec) for every reason

    def __post_init__(self):
        if not 0.0 <= self.prefill_low_share <= 1.0:
            raise ValueError(f"prefill_low_share must be in [0, 1], got {self.prefill_low_share}")

    @classmethod
    def preset(cls, name: str) -> "QuantPolicy":
        """fate (INT4 cache/prefetch, INT2 misses and half the prefill), fp16 (none), and every expert at one
        precision: int8, int4, int3 (g64), int2 (g32)."""
        if name == "fate":
            int4, int2 = QuantSpec.preset("int4"), QuantSpec.preset("int2")
            # The paper does not publish the share of prefill experts sent at INT2; 0.5 is our knob.
            return cls(cache=int4, prefetch=int4, prefill_low=int2, prefill_low_share=0.5, miss=int2)
        if name in ("fp16", "fate_fp16"):
            return cls()
        if name in ("int8", "int4", "int3", "int2"):
            s = QuantSpec.preset(name)
            return cls(cache=s, prefetch=s, prefill_low=s, prefill_low_share=0.0, miss=s)
        raise ValueError(f"unknown QuantPolicy preset {name!r}; known: fate, fp16, fate_fp16, int8, int4, int3, int2")

    def with_shallow(self, num_layers: int, spec: QuantSpec | None) -> "QuantPolicy":
        """This policy with MoE layers 0..num_layers-1 kept at spec for every reason."""
        kept = tuple((m, s) for m, s in self.layer_overrides if m >= num_layers)
        return replace(self, layer_overrides=tuple((m, spec) for m in range(num_layers)) + kept)

    def precision_for(self, layer: int, reason: str) -> QuantSpec | None:
        """The spec for an expert of MoE layer `layer` held or moved for `reason` (None: full)."""
        if reason not in REASONS:
            raise ValueError(f"unknown reason {reason!r}; use one of {REASONS}")
        for m, spec in self.layer_overrides:
            if m == layer:
                return spec
        return getattr(self, reason)

    def host_specs(self, layer: int) -> tuple[QuantSpec | None, ...]:
        """The distinct precisions the host store must keep for a layer's experts."""
        out: list[QuantSpec | None] = []
        for reason in REASONS:
            if reason == "prefill_low" and self.prefill_low_share == 0.0:
                continue
            spec = self.precision_for(layer, reason)
            if spec not in out:
                out.append(spec)
        return tuple(out)

    def prefill_low_count(self, num_predicted: int) -> int:
        """How many of num_predicted prefill experts (least popular first) travel at prefill_low."""
        return int(math.floor(self.prefill_low_share * num_predicted))
