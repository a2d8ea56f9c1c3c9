"""Probe fate_lab with bad input, as a new user would, and count what happens.

Every probe calls a public entry point with a value a user could pass by mistake and expects an error. The
outcome is one of: a clear error (ValueError / TypeError / FileNotFoundError / IsADirectoryError /
RuntimeError whose message names the argument or the value), an unclear error (any other exception, or a
message that names neither), or a silent accept (no error at all). A probe of a valid input (no text to find)
must run: an error there is unclear. A command-line probe runs `python -m fate_lab ...` in this process: a clear
error is a non-zero exit whose message names the flag, with no traceback.

Surfaces: the configs, links and profiles, the simulator, replay and traces (`probes`); checkpoint folders opened
by `load_offloaded` and `load_model` (`checkpoint_probes`); traces, routing arrays and quantization
(`trace_probes`); every replacement policy by name and the planned presets `auto` / `auto_quant`
(`policy_probes`); the sizing tool's command line, `sweep` / `miss_curves` / the simulator's shape checks and a
1-token prompt's TTFT (`pending_probes`: each names the issue that fixes it, and until that issue lands its
failures are counted apart, as pending, so a rerun after the merge counts them). Run on a CPU in 10-30 s:

    python scripts/probe_inputs.py            # prints one line per probe and the counts
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
import struct
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import torch

CLEAR = (ValueError, TypeError, FileNotFoundError, IsADirectoryError, NotADirectoryError, RuntimeError,
         NotImplementedError)


class Unclear(Exception):
    """A command-line probe that printed a traceback or a message naming neither the flag nor the value."""


class SilentAccept(Exception):
    """A probe whose call returned a result it should have refused (e.g. a NaN the caller cannot use)."""


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
    yield "config: transfer_timeout_s=nan", "transfer_timeout_s", lambda: OffloadConfig.preset(
        "fate", transfer_timeout_s=math.nan)
    yield "config: transfer_timeout_s=0", "transfer_timeout_s", lambda: OffloadConfig.preset(
        "fate", transfer_timeout_s=0)
    yield "config: transfer_timeout_s=-1", "transfer_timeout_s", lambda: OffloadConfig.preset(
        "fate", transfer_timeout_s=-1)
    yield "config: admit_prefetch='sometimes'", "admit_prefetch", lambda: OffloadConfig.preset(
        "fate", admit_prefetch="sometimes")
    yield "config: calibration_steps=0", "calibration_steps", lambda: OffloadConfig.preset("fate", calibration_steps=0)
    yield "config: prefetch_buffer_experts=-2", "prefetch_buffer_experts=-2", lambda: OffloadConfig.preset(
        "fate", prefetch_buffer_experts=-2)
    yield "config: slots=2.5", "slots", lambda: OffloadConfig.preset("fate", slots=2.5)
    yield "config: budget=-1", "budget", lambda: OffloadConfig.preset("fate", budget=-1)
    yield "config: link='pcie9'", "link", lambda: OffloadConfig.preset("fate", link="pcie9")
    yield "config: quant='int5'", "quant", lambda: OffloadConfig.preset("fate", quant="int5")
    yield "config: replacement='fifo'", "replacement", lambda: OffloadConfig.preset("fate", replacement="fifo")
    yield "config: context_len=0", "context_len", lambda: OffloadConfig.preset("fate", context_len=0)
    yield "config: prefetch_window=inf", "prefetch_window", lambda: OffloadConfig.preset(
        "fate", prefetch_window=math.inf)
    yield "config: layer_compute_s=nan", "layer_compute_s", lambda: OffloadConfig.preset(
        "fate", layer_compute_s=math.nan)
    yield "config: lossy_threshold=nan", "lossy_threshold", lambda: OffloadConfig.preset(
        "fate", lossy_threshold=math.nan)
    yield "config: min_similarity=2", "min_similarity", lambda: OffloadConfig.preset("substitute", min_similarity=2.0)
    yield "config: cache='yes'", "cache", lambda: OffloadConfig.preset("fate", cache="yes")
    yield "offload: store='ssd' without checkpoint", "checkpoint", lambda: fate_lab.offload(
        model, OffloadConfig.preset("fate", store="ssd"))
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
    yield "simulate: layers differ", "MoE layers", lambda: simulate(
        tr, OffloadConfig.preset("lru", slots=2), Hardware(prof, link),
        ModelShape(3, 3, 8, 2, 8, 8, torch.float32, 0, 0))
    yield "simulate: fate on a routing-only trace", "gate inputs", lambda: simulate(
        from_routing_array(torch.tensor([[[0, 1], [1, 2]]]), num_experts=8), OffloadConfig.preset("fate", slots=4),
        Hardware(prof, link), shape8)
    yield "simulate: not a config", "OffloadConfig", lambda: simulate(
        tr, {"preset": "lru"}, Hardware(prof, link), shape8)
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
    yield "routing array: 0 tokens", "0 tokens", lambda: from_routing_array(
        torch.zeros(0, 2, 2, dtype=torch.long), num_experts=4)
    yield "routing array: floats", "integer", lambda: from_routing_array(torch.rand(2, 1, 2), num_experts=4)
    yield "routing array: k > E", "k=", lambda: from_routing_array(torch.tensor([[[0, 1, 2]]]), num_experts=2)
    yield "trace: load a folder", "folder", lambda: Trace.load(tmp)
    (tmp / "bad.safetensors").write_bytes(b"not a safetensors file at all")
    yield "trace: load a corrupt file", "bad.safetensors", lambda: Trace.load(tmp / "bad.safetensors")
    yield "trace: load a missing file", "nothing", lambda: Trace.load(tmp / "nothing.safetensors")
    yield "record_trace: prompts=[]", "prompts", lambda: record_trace(model, None, [], progress=False)
    yield "record_trace: decode_tokens=2.5", "decode_tokens", lambda: record_trace(
        model, None, [[1, 2]], decode_tokens=2.5, progress=False)
    yield "record_trace: out-of-vocabulary id", "vocabulary", lambda: record_trace(
        model, None, [[1, 500]], progress=False)
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


def _cli(*argv: str):
    """A call that runs `python -m fate_lab <argv>` in this process: ValueError(its message) on a clean non-zero exit,
    Unclear on a traceback, the printed output on success."""
    from fate_lab.cli import main as cli_main

    def call():
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                cli_main(list(argv))
        except SystemExit as stop:
            if stop.code in (0, None):
                return out.getvalue()
            msg = stop.code if isinstance(stop.code, str) else err.getvalue().strip().splitlines()[-1:] or ["(none)"]
            raise ValueError(msg if isinstance(msg, str) else msg[0]) from None
        except Exception as exc:  # what a user sees is a traceback
            raise Unclear(f"traceback: {type(exc).__name__}: {str(exc)[:100]}") from None
        return out.getvalue()
    return call


def _olmoe_folder(tmp: Path) -> Path:
    """A tiny OLMoE checkpoint (one file) with the embedded model's tokenizer files."""
    from fate_lab.model.testing import tiny_model
    from fate_lab.paths import TINY_MOE_DIR

    folder = tmp / "olmoe"
    tiny_model("olmoe", seed=0).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MOE_DIR / name, folder / name)
    return folder


def checkpoint_probes(tmp: Path):
    """Broken checkpoint folders, opened by load_offloaded and load_model."""
    import fate_lab
    from fate_lab import OffloadConfig
    from fate_lab.offloading.load import load_offloaded

    good = _olmoe_folder(tmp)
    cfg = OffloadConfig.preset("fate", store="ssd", link="instant", slots=4)

    def broken(name: str, edit) -> Path:
        folder = tmp / name
        shutil.copytree(good, folder)
        edit(folder)
        return folder

    def config(**changes):
        def edit(folder):
            raw = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**raw, **changes}))
        return edit

    def weights(edit_tensors):
        def edit(folder):
            from safetensors.torch import load_file, save_file
            tensors = load_file(folder / "model.safetensors")
            edit_tensors(tensors)
            save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return edit

    def raw_file(data):
        return lambda folder: (folder / "model.safetensors").write_bytes(data(folder / "model.safetensors"))

    def sharded(edit):
        def make(folder):
            from fate_lab.model.testing import tiny_model

            (folder / "model.safetensors").unlink()
            tiny_model("olmoe", seed=0).save_pretrained(folder, max_shard_size="100KB")
            edit(folder)
        return make

    cases = {
        "truncated file": (raw_file(lambda f: f.read_bytes()[:-1000]), "model.safetensors"),
        "header too small": (raw_file(lambda f: b"\x01\x00"), "model.safetensors"),
        "invalid header length": (raw_file(lambda f: struct.pack("<Q", 4) + b"{}"), "model.safetensors"),
        "header too large": (raw_file(lambda f: struct.pack("<Q", 10**12) + f.read_bytes()[8:]), "model.safetensors"),
        "a shard's header too small": (sharded(lambda d: sorted(d.glob("*.safetensors"))[1].write_bytes(b"\x01")),
                                       "model-00002-of-"),
        "index not JSON": (sharded(lambda d: (d / "model.safetensors.index.json").write_text("{not json")),
                           "index.json"),
        "a shard missing": (sharded(lambda d: sorted(d.glob("*.safetensors"))[-1].unlink()), "shards that are not"),
        "dtype 'banana'": (config(dtype="banana"), "banana"),
        "config.json not JSON": (lambda d: (d / "config.json").write_text("{"), "config.json"),
        "config.json a list": (lambda d: (d / "config.json").write_text("[1]"), "config.json"),
        "config.json without model_type": (lambda d: (d / "config.json").write_text("{}"), "model_type"),
        "an expert tensor deleted": (weights(lambda t: t.pop("model.layers.0.mlp.experts.0.down_proj.weight")),
                                     "experts.0.down_proj"),
        "size mismatch (vocab)": (config(vocab_size=130), "model.embed_tokens.weight"),
    }
    for name, (edit, needle) in cases.items():
        folder = broken(name.replace(" ", "_").replace("'", ""), edit)
        yield f"load_offloaded: {name}", needle, lambda f=folder: load_offloaded(f, cfg)
        yield f"load_model: {name}", needle, lambda f=folder: fate_lab.load_model(f)
    yield "load_offloaded: store='ram'", "store", lambda: load_offloaded(
        good, OffloadConfig.preset("fate", store="ram"))
    yield "load_offloaded: a file", "checkpoint folder", lambda: load_offloaded(good / "model.safetensors", cfg)
    yield "load_offloaded: config is a str", "OffloadConfig", lambda: load_offloaded(good, "fate")
    yield "load_offloaded: dtype 'fp12'", "dtype", lambda: load_offloaded(good, cfg, dtype="fp12")


def trace_probes(tmp: Path):
    """Routing arrays, trace files and quantization inputs."""
    from safetensors.torch import save_file

    from fate_lab import from_routing_array
    from fate_lab.model.trace import Trace
    from fate_lab.quant import QuantSpec, quantize

    def empty_file(shape) -> Path:
        n = shape[0]
        tensors = {"experts": torch.zeros(shape, dtype=torch.int64), "phase": torch.ones(n, dtype=torch.int64)}
        tensors.update({k: torch.zeros(n, dtype=torch.int64) for k in ("token_ids", "prompt_id", "position")})
        path = tmp / f"empty_{'x'.join(map(str, shape))}.safetensors"
        save_file(tensors, str(path), metadata={"fate_lab_trace": '{"format_version": 1, "num_experts": 4}'})
        return path

    yield "routing array: 0 layers", "0 layers", lambda: from_routing_array(torch.zeros(2, 0, 2, dtype=torch.long),
                                                                            num_experts=4)
    yield "routing array: k=0", "k=0", lambda: from_routing_array(torch.zeros(2, 2, 0, dtype=torch.long), num_experts=4)
    yield "routing array: ragged lists", "rectangular", lambda: from_routing_array([[[0, 1]], [[1]]], num_experts=4)
    yield "routing array: bool ids", "integer", lambda: from_routing_array(torch.ones(2, 1, 1, dtype=torch.bool))
    yield "routing array: lengths negative", "lengths", lambda: from_routing_array(
        torch.tensor([[[0, 1]], [[1, 2]]]), num_experts=3, lengths=[3, -1])
    yield "trace: load a 0-token file", "empty trace", lambda: Trace.load(empty_file((0, 2, 2)))
    yield "trace: load a 0-layer file", "empty trace", lambda: Trace.load(empty_file((3, 0, 2)))
    yield "trace: metadata not a JSON object", "JSON object", lambda: Trace.load(_trace_with_meta(tmp, "[1, 2]"))
    yield "quantize: a bool tensor", "torch.bool", lambda: quantize(
        torch.ones(1, 64, dtype=torch.bool), QuantSpec(4, 64))
    yield "quantize: a numpy array", "numpy", lambda: quantize(np.ones((1, 64), np.float32), QuantSpec(4, 64))
    yield "quantize: group does not divide", "group_size", lambda: quantize(torch.randn(2, 48), QuantSpec(4, 64))


def _trace_with_meta(tmp: Path, meta: str) -> Path:
    """A trace file whose 'fate_lab_trace' metadata is `meta`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from fate_lab import from_routing_array

    path = tmp / "meta.safetensors"
    from_routing_array(torch.tensor([[[0, 1]], [[1, 2]]]), num_experts=3).save(path)
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    save_file(tensors, str(path), metadata={"fate_lab_trace": meta})
    return path


def policy_probes(tmp: Path):
    """Every replacement policy by name (each must replay and simulate a recorded trace), bad names, and the
    planned presets. Cases whose fix lies outside the model side carry the lead's triage tag."""
    import fate_lab
    from fate_lab import OffloadConfig
    from fate_lab.hardware.compute import ComputeProfile
    from fate_lab.hardware.links import LinkProfile
    from fate_lab.hardware.setups import Hardware
    from fate_lab.model.record import record_trace
    from fate_lab.model.testing import tiny_model
    from fate_lab.policy.registry import POLICIES
    from fate_lab.sim.replay import replay, trace_shape
    from fate_lab.sim.simulate import simulate

    trace = record_trace(tiny_model("olmoe", seed=0), None, [[5, 6, 7, 8, 9, 10]], decode_tokens=6, progress=False)
    shape = trace_shape(trace)
    hw = Hardware(ComputeProfile("p", 1e-3, 0.0, 1e-4, 0.0, 0.0, 0.0), LinkProfile("l", 1e9, 1e-5))
    for name in POLICIES:
        yield f"replay: policy={name!r} works", None, lambda n=name: replay(trace, slots_per_layer=3, policy=n)
        yield f"simulate: replacement={name!r} works", None, lambda n=name: simulate(
            trace, OffloadConfig.preset("lru", slots=6, replacement=n), hw, shape), *(
            ("Belady in the simulator (it gives Belady no future)",) if name == "belady" else ())
    yield "replay: policy='LRU' (any case) works", None, lambda: replay(trace, slots_per_layer=3, policy="LRU")
    yield "replay: policy=3", "policy", lambda: replay(trace, slots_per_layer=3, policy=3)
    yield "replay: policy='lru '", "replacement", lambda: replay(trace, slots_per_layer=3, policy="lru ")
    yield "config: replacement=None", "replacement", lambda: OffloadConfig.preset("lru", replacement=None)
    yield "config: auto='yes'", "auto", lambda: OffloadConfig.preset("auto", auto="yes")
    yield "config: auto_quant quant='int5'", "quant", lambda: OffloadConfig.preset("auto_quant", quant="int5")
    yield "simulate: auto without a compute profile", "compute", lambda: fate_lab.simulate(
        trace, OffloadConfig.preset("auto", slots=6), Hardware(None, hw.link), shape)
    yield "simulate: auto on a shape of no model folder", "calibration", lambda: fate_lab.simulate(
        trace, OffloadConfig.preset("auto", slots=6), hw, shape)
    yield "sim.simulate (below the planner): auto is refused naming the call that plans", "fate_lab.simulate", \
        lambda: simulate(trace, OffloadConfig.preset("auto", slots=6), hw, shape)
    model = tiny_model("olmoe", seed=0)
    for slots in (0, 8, 10**6):
        yield f"offload: auto with slots={slots} plans and generates", None, lambda n=slots: _auto_generates(model, n)
    yield "offload: auto with slots=-1", "slots", lambda: _auto_generates(model, -1)


def _auto_generates(model, slots: int) -> None:
    """Offload model under the `auto` preset (planned from the model itself) and generate 3 tokens."""
    import fate_lab

    with fate_lab.offload(model, fate_lab.OffloadConfig.preset("auto", link="instant", slots=slots)):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, do_sample=False, pad_token_id=0)


def pending_probes(tmp: Path):
    """Cases other issues fix, each tagged with its issue: (name, needle, call, issue)."""
    from fate_lab import OffloadConfig, from_routing_array
    from fate_lab.core.shape import ModelShape
    from fate_lab.hardware.compute import ComputeProfile
    from fate_lab.hardware.links import LinkProfile
    from fate_lab.hardware.setups import Hardware
    from fate_lab.paths import TINY_MOE_DIR
    from fate_lab.sim.replay import miss_curves, sweep
    from fate_lab.sim.simulate import simulate

    raw = json.loads((TINY_MOE_DIR / "config.json").read_text())

    def config_file(name: str, text: str) -> str:
        path = tmp / "plan" / name / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)

    def edited(**changes) -> str:
        return config_file("_".join(f"{k}{v}" for k, v in changes.items()), json.dumps({**raw, **changes}))

    plan = ("plan", "--model", "tiny_moe", "--device", "rtx4090")
    cases = [
        ("400-digit budget", "--budget", (*plan, "--budget", "1" + "0" * 400)),
        ("budget '12' (no unit)", "--budget", (*plan, "--budget", "12")),
        ("context 1e8", "--context", (*plan, "--budget", "8GiB", "--context", "100000000")),
        ("config.json not JSON", "config.json", ("plan", "--model", config_file("notjson", "{"), "--device", "rtx4090",
                                                 "--budget", "8GiB")),
        ("config.json empty", "config.json", ("plan", "--model", config_file("empty", ""), "--device", "rtx4090",
                                              "--budget", "8GiB")),
        ("config.json a list", "config.json", ("plan", "--model", config_file("list", "[1]"), "--device", "rtx4090",
                                               "--budget", "8GiB")),
        ("config.json without model_type", "model_type", ("plan", "--model", config_file("nomt", "{}"), "--device",
                                                          "rtx4090", "--budget", "8GiB")),
        ("hidden_size=-4096", "hidden_size", ("plan", "--model", edited(hidden_size=-4096), "--device", "rtx4090",
                                              "--budget", "8GiB")),
        ("zero experts", "num_experts", ("plan", "--model", edited(num_experts=0), "--device", "rtx4090", "--budget",
                                         "8GiB")),
        ("zero expert width", "moe_intermediate_size", ("plan", "--model", edited(moe_intermediate_size=0), "--device",
                                                        "rtx4090", "--budget", "8GiB")),
        ("top_k 0", "num_experts_per_tok", ("plan", "--model", edited(num_experts_per_tok=0), "--device", "rtx4090",
                                            "--budget", "8GiB")),
    ]
    for name, needle, argv in cases:
        yield f"plan CLI: {name}", needle, _cli(*argv)

    def strict_json():
        out = _cli(*plan, "--budget", "8GiB", "--json")()
        json.loads(out, parse_constant=lambda c: (_ for _ in ()).throw(SilentAccept(f"--json wrote {c}")))
    yield "plan CLI: --json is strict JSON (valid input)", None, strict_json

    ex = torch.tensor([[[0, 1], [1, 2]], [[1, 2], [0, 2]]])  # 2 tokens, 2 layers, ids < 3
    yield "sweep: n_jobs=0", "n_jobs", lambda: sweep(
        ex, boundaries=[0], budgets=[2], num_experts=3, n_jobs=0)
    yield "miss_curves: n_jobs=0", "n_jobs", lambda: miss_curves(ex, 3, n_jobs=0)
    yield "sweep: boundary 8 > 2 layers", "boundar", lambda: sweep(ex, boundaries=[8], budgets=[4], num_experts=3)
    yield "sweep: trace of 8 experts, num_experts=3", "num_experts", lambda: sweep(
        from_routing_array(ex, num_experts=8), boundaries=[0], budgets=[2], num_experts=3)
    link, prof = LinkProfile("l", 1e9, 1e-5), ComputeProfile("p", 1e-3, 0.0, 1e-4, 0.0, 0.0, 0.0)
    yield "simulate: 64-expert shape, 32-expert trace", "experts", lambda: simulate(
        from_routing_array(torch.tensor([[[0, 1], [3, 9]]]), num_experts=32), OffloadConfig.preset("lru", slots=4),
        Hardware(prof, link), ModelShape(2, 2, 64, 2, 8, 8, torch.float32, 0, 0))

    def one_token_prompt_ttft():
        trace = from_routing_array(torch.tensor([[[0, 1]], [[1, 2]], [[2, 3]]]), num_experts=4,
                                   phase=["prefill", "decode", "decode"])
        stats = simulate(trace, OffloadConfig.preset("lru", slots=2), Hardware(prof, link),
                         ModelShape(1, 1, 4, 2, 8, 8, torch.float32, 0, 0))
        if not math.isfinite(stats.ttft_s):
            raise SilentAccept(f"a 1-token prompt's TTFT is {stats.ttft_s}")
    yield "simulate: 1-token prompt has a TTFT (valid input)", None, one_token_prompt_ttft


def _classify(needle: str | None, call) -> tuple[str, str]:
    """(outcome, detail) of one probe."""
    try:
        call()
    except Exception as exc:  # classify what a user would see
        msg = str(exc)
        if needle is None or isinstance(exc, (Unclear, SilentAccept)):
            kind = "silent accept" if isinstance(exc, SilentAccept) else "unclear error"
            return kind, f"{type(exc).__name__}: {msg[:110]}"
        ok = isinstance(exc, CLEAR) and needle.lower() in msg.lower()
        detail = f"{type(exc).__name__}: {msg[:110]}"
        if not ok and not isinstance(exc, CLEAR):
            detail += " | " + traceback.format_exc().splitlines()[-3].strip()[:80]
        return ("clear error" if ok else "unclear error"), detail
    return ("ok" if needle is None else "silent accept"), ""


def main() -> int:
    """Run every probe; print one line each and the counts; exit 1 on an unclear error or a silent accept outside
    the pending cases."""
    import warnings

    warnings.filterwarnings("ignore")
    counts = {"clear error": 0, "unclear error": 0, "silent accept": 0, "ok": 0}
    pending: dict[str, list[str]] = {}
    tmp = Path(tempfile.mkdtemp())
    groups = [probes(), checkpoint_probes(tmp), trace_probes(tmp), policy_probes(tmp), pending_probes(tmp)]
    for case in (c for group in groups for c in group):
        name, needle, call, issue = (*case, None)[:4]
        kind, detail = _classify(needle, call)
        if issue is not None and kind in ("unclear error", "silent accept"):
            pending.setdefault(issue, []).append(name)
            kind_shown = f"pending ({issue}): {kind}"
        else:
            counts[kind] += 1
            kind_shown = kind
        print(f"{kind_shown:14s} {name:48s} {detail}")
    shutil.rmtree(tmp, ignore_errors=True)
    total = sum(counts.values()) + sum(len(v) for v in pending.values())
    print("\n" + ", ".join(f"{k}: {v}" for k, v in counts.items()) + f" (of {total} probes)")
    for issue, names in pending.items():
        print(f"pending on {issue}: {len(names)} ({'; '.join(names)})")
    return 0 if counts["unclear error"] == counts["silent accept"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
