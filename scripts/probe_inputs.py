"""Probe fate_lab with bad input, as a new user would, and count what happens.

Every probe calls a public entry point with a value a user could pass by mistake and expects an error. The
outcome is one of: a clear error (ValueError / TypeError / FileNotFoundError / IsADirectoryError /
RuntimeError whose message names the argument or the value), an unclear error (any other exception, or a
message that names neither), or a silent accept (no error at all). Run on a CPU in a minute or two:

    python scripts/probe_inputs.py            # prints one line per probe and the counts
"""
from __future__ import annotations

import math
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch

CLEAR = (ValueError, TypeError, FileNotFoundError, IsADirectoryError, NotADirectoryError, RuntimeError,
         NotImplementedError)


def probes():
    """(name, the text the message must hold (the argument or the value), a call that must raise)."""
    import fate_lab
    from fate_lab import OffloadConfig, from_routing_array
    from fate_lab.core.shape import ModelShape
    from fate_lab.hardware.compute import ComputeProfile
    from fate_lab.hardware.hosts import HostProfile
    from fate_lab.hardware.links import LinkProfile
    from fate_lab.hardware.setups import Hardware
    from fate_lab.model.record import record_trace
    from fate_lab.model.testing import tiny_model
    from fate_lab.model.trace import Trace
    from fate_lab.quant import QuantSpec, quantize
    from fate_lab.sim.replay import miss_curves, replay, sweep
    from fate_lab.sim.simulate import simulate
    from fate_lab.study.plan import parse_bytes

    ex = torch.tensor([[[0, 1]], [[1, 2]]])
    tr = from_routing_array(ex, num_experts=3)
    shape8 = ModelShape(2, 2, 8, 2, 8, 8, torch.float32, 0, 0)
    prof = ComputeProfile("p", 1e-3, 0.0, 1e-4, 0.0, 0.0, 0.0)
    link = LinkProfile("l", 1e9, 1e-5)
    model = tiny_model("olmoe", seed=0)
    tmp = Path(tempfile.mkdtemp())
    yield "config: transfer_timeout_s=nan", "transfer_timeout_s", lambda: OffloadConfig.preset("fate", transfer_timeout_s=math.nan)
    yield "config: transfer_timeout_s=0", "transfer_timeout_s", lambda: OffloadConfig.preset("fate", transfer_timeout_s=0)
    yield "config: transfer_timeout_s=-1", "transfer_timeout_s", lambda: OffloadConfig.preset("fate", transfer_timeout_s=-1)
    yield "config: admit_prefetch='sometimes'", "admit_prefetch", lambda: OffloadConfig.preset("fate", admit_prefetch="sometimes")
    yield "config: calibration_steps=0", "calibration_steps", lambda: OffloadConfig.preset("fate", calibration_steps=0)
    yield "config: prefetch_buffer_experts=-2", "prefetch_buffer_experts=-2", lambda: OffloadConfig.preset("fate", prefetch_buffer_experts=-2)
    yield "config: slots=2.5", "slots", lambda: OffloadConfig.preset("fate", slots=2.5)
    yield "config: budget=-1", "budget", lambda: OffloadConfig.preset("fate", budget=-1)
    yield "config: link='pcie9'", "link", lambda: OffloadConfig.preset("fate", link="pcie9")
    yield "config: quant='int5'", "quant", lambda: OffloadConfig.preset("fate", quant="int5")
    yield "config: replacement='fifo'", "replacement", lambda: OffloadConfig.preset("fate", replacement="fifo")
    yield "config: context_len=0", "context_len", lambda: OffloadConfig.preset("fate", context_len=0)
    yield "config: prefetch_window=inf", "prefetch_window", lambda: OffloadConfig.preset("fate", prefetch_window=math.inf)
    yield "config: layer_compute_s=nan", "layer_compute_s", lambda: OffloadConfig.preset("fate", layer_compute_s=math.nan)
    yield "config: lossy_threshold=nan", "lossy_threshold", lambda: OffloadConfig.preset("fate", lossy_threshold=math.nan)
    yield "config: min_similarity=2", "min_similarity", lambda: OffloadConfig.preset("substitute", min_similarity=2.0)
    yield "config: cache='yes'", "cache", lambda: OffloadConfig.preset("fate", cache="yes")
    yield "offload: store='ssd' without checkpoint", "checkpoint", lambda: fate_lab.offload(model, OffloadConfig.preset("fate", store="ssd"))
    yield "config: rule='percentile'", "rule", lambda: OffloadConfig.preset("fate", rule="percentile")
    yield "config: unknown preset", "unknown preset", lambda: OffloadConfig.preset("fastest")
    yield "config: unknown field", "no field", lambda: OffloadConfig.preset("fate", slotz=4)
    yield "link: negative bandwidth", "bandwidth", lambda: LinkProfile("l", -1e9, 0.0)
    yield "link: zero bandwidth", "bandwidth", lambda: LinkProfile("l", 0.0, 0.0)
    yield "link: negative latency", "latency", lambda: LinkProfile("l", 1e9, -1e-6)
    yield "compute: expert_s=-1", "expert_s", lambda: ComputeProfile("p", 1e-3, 0.0, -1, 0.0, 0.0, 0.0)
    yield "compute: all zero", "no time", lambda: ComputeProfile("p", 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    yield "compute: NaN", "nan", lambda: ComputeProfile("p", math.nan, 0.0, 1e-4, 0.0, 0.0, 0.0)
    yield "host: zero flops", "flops", lambda: HostProfile("h", 1e9, 0.0, 1e-5)
    yield "shape: top_k > experts", "top_k", lambda: ModelShape(2, 2, 4, 8, 8, 8, torch.float32, 0, 0)
    yield "shape: negative dense bytes", "dense_bytes", lambda: ModelShape(2, 2, 8, 2, 8, 8, torch.float32, -1, 0)
    yield "simulate: trace ids above the shape's experts", "up to 15", lambda: simulate(
        from_routing_array(torch.tensor([[[0, 15], [3, 9]]]), num_experts=16), OffloadConfig.preset("lru", slots=4),
        Hardware(prof, link), shape8)
    yield "simulate: layers differ", "MoE layers", lambda: simulate(tr, OffloadConfig.preset("lru", slots=2),
                                                                    Hardware(prof, link), ModelShape(3, 3, 8, 2, 8, 8, torch.float32, 0, 0))
    yield "simulate: fate on a routing-only trace", "gate inputs", lambda: simulate(
        from_routing_array(torch.tensor([[[0, 1], [1, 2]]]), num_experts=8), OffloadConfig.preset("fate", slots=4),
        Hardware(prof, link), shape8)
    yield "simulate: not a config", "OffloadConfig", lambda: simulate(tr, {"preset": "lru"}, Hardware(prof, link), shape8)
    yield "simulate: no compute profile", "compute profile", lambda: simulate(
        from_routing_array(torch.tensor([[[0, 1], [1, 2]]]), num_experts=8), OffloadConfig.preset("lru", slots=4),
        Hardware(None, link), shape8)
    yield "replay: negative id", "expert ids", lambda: replay(torch.tensor([[[-1, 2]]]), slots_per_layer=2)
    yield "replay: duplicate ids", "repeats", lambda: replay(torch.tensor([[[1, 1]]]), slots_per_layer=2)
    yield "replay: slots 2.5", "slots_per_layer", lambda: replay(ex, slots_per_layer=2.5)
    yield "replay: slots None", "slots_per_layer", lambda: replay(ex)
    yield "replay: wrong number of layers", "slots_per_layer", lambda: replay(ex, slots_per_layer=[2, 2])
    yield "replay: phase 'warmup'", "phase", lambda: replay(ex, slots_per_layer=2, phase="warmup")
    yield "replay: unknown policy", "replacement", lambda: replay(ex, slots_per_layer=2, policy="fifo")
    yield "sweep: admit 'sometimes'", "admit_prefetch", lambda: sweep(ex, boundaries=[0], budgets=[2], num_experts=3,
                                                                      admit_prefetch="sometimes")
    yield "miss_curves: too few experts", "num_experts", lambda: miss_curves(ex, 2)
    yield "miss_curves: 10^6 experts", "max_replays", lambda: miss_curves(ex, 10**6)
    yield "routing array: 0 tokens", "0 tokens", lambda: from_routing_array(torch.zeros(0, 2, 2, dtype=torch.long), num_experts=4)
    yield "routing array: floats", "integer", lambda: from_routing_array(torch.rand(2, 1, 2), num_experts=4)
    yield "routing array: k > E", "k=", lambda: from_routing_array(torch.tensor([[[0, 1, 2]]]), num_experts=2)
    yield "trace: load a folder", "folder", lambda: Trace.load(tmp)
    (tmp / "bad.safetensors").write_bytes(b"not a safetensors file at all")
    yield "trace: load a corrupt file", "bad.safetensors", lambda: Trace.load(tmp / "bad.safetensors")
    yield "trace: load a missing file", "nothing", lambda: Trace.load(tmp / "nothing.safetensors")
    yield "record_trace: prompts=[]", "prompts", lambda: record_trace(model, None, [], progress=False)
    yield "record_trace: decode_tokens=2.5", "decode_tokens", lambda: record_trace(model, None, [[1, 2]], decode_tokens=2.5, progress=False)
    yield "record_trace: out-of-vocabulary id", "vocabulary", lambda: record_trace(model, None, [[1, 500]], progress=False)
    yield "record_trace: one string", "single string", lambda: record_trace(model, None, "hello", progress=False)
    yield "quantize(w, 4)", "QuantSpec", lambda: quantize(torch.randn(4, 64), 4)
    yield "QuantSpec(5, 64)", "bits", lambda: QuantSpec(5, 64)
    yield "QuantSpec(4, 0)", "group_size", lambda: QuantSpec(4, 0)
    yield "offload: not a config", "OffloadConfig", lambda: fate_lab.offload(model, "fate")
    yield "offload: budget below the minimum", "minimum working set", lambda: fate_lab.offload(
        model, OffloadConfig.preset("lru", budget=10, link="instant"))
    yield "load_model: a missing folder", "does not exist", lambda: fate_lab.load_model(tmp / "nope")
    yield "load_model: a file", "is a file", lambda: fate_lab.load_model(tmp / "bad.safetensors")
    yield "plan: budget '12 parsecs'", "budget", lambda: parse_bytes("12 parsecs")
    yield "plan: unknown device", "device", lambda: __import__("fate_lab.study.plan", fromlist=["plan"]).plan(
        "tiny_moe", "rtx9090", "1GiB")
    yield "replay: numpy int slots work (no error expected)", None, lambda: replay(ex, slots_per_layer=np.int64(2))


def main() -> int:
    counts = {"clear error": 0, "unclear error": 0, "silent accept": 0, "ok": 0}
    for name, needle, call in probes():
        try:
            call()
        except Exception as exc:  # classify what a user would see
            msg = str(exc)
            ok = isinstance(exc, CLEAR) and (needle is None or needle.lower() in msg.lower())
            kind = "clear error" if ok else "unclear error"
            detail = f"{type(exc).__name__}: {msg[:110]}"
            if not ok and not isinstance(exc, CLEAR):
                detail += " | " + traceback.format_exc().splitlines()[-3].strip()[:80]
        else:
            kind = "ok" if needle is None else "silent accept"
            detail = ""
        counts[kind] += 1
        print(f"{kind:14s} {name:48s} {detail}")
    print("\n" + ", ".join(f"{k}: {v}" for k, v in counts.items()) + f" (of {sum(counts.values())} probes)")
    return 0 if counts["unclear error"] == counts["silent accept"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
