"""A model larger than its RAM budget: a 4.5 GB random Mixtral streamed from this machine's disk (link="disk").

The checkpoint: transformers' Mixtral (per-expert w1/w2/w3 tensors, as Mixtral ships), bfloat16, random weights,
hidden 1024, expert width 2816, 8 layers of 32 experts, top-4 (the embedded tiny_moe's routing geometry, so its
trained routing can be replayed on this shape's timing), 4.4 GB of routed experts (17.3 MB each); built once
into --dir (about a minute), with the embedded model's tokenizer.

Part 1, in this process (the whole model in RAM, so every row has the same model and the all-resident baseline):
- `all_resident`: the plain model (eager experts kernel, the math the runtime runs), no offloading;
- `load_on_demand`, `lru`, `fate`, `auto` offloaded with `link="disk"`, `store="ssd"`, --share of the experts in
  the cache: every expert that moves is an O_DIRECT read of the checkpoint, every row starts with empty slots;
- beside each row the simulator's prediction on this machine's Hardware (`machine_hardware(model, tok,
  link="disk")`: compute calibrated from the runtime, the disk measured now with O_DIRECT reads), from the trace
  of this model's own routing (random weights route almost uniformly) and from the trained tiny_moe's routing
  on the same prompts (how a trained model of this shape would fare; no runtime row measures it);
- repeats interleaved; each run checked against the disk's bound (the checkpoint bytes read at the best O_DIRECT
  bandwidth measured).

Part 2, in child processes under a memory cap (a cgroup v1 memory controller, which charges page-cache pages to
the process that faults them): the same cap for each, the child's own memory after setup + the cache budget +
512 MiB (the runtime's own memory beyond its slots is about 300 MiB on this model; the mmap run gets the rest as
page cache). `load_offloaded` + `lru` and `fate` over the disk link (the experts never all in RAM), against the
baseline an edge user tries first, llama.cpp's way: the checkpoint memory-mapped, experts computed straight from
the mapping, the OS page cache as the expert cache. Without a writable memory cgroup, part 2 says so and stops.

    python -m benchmarks.bench_big_disk --out benchmarks/results/big_disk_$(date +%F).md
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SIZES = dict(hidden_size=1024, intermediate_size=2816, num_local_experts=32, num_experts_per_tok=4,
             num_hidden_layers=8, vocab_size=8192, num_attention_heads=8, num_key_value_heads=2,
             max_position_embeddings=1024)
ROUTER_STD = 0.0625  # router logits of std ~2 on hidden 1024 (tiny_model's 0.25 is for hidden 64)
PRESETS = ["load_on_demand", "lru", "fate", "auto"]
CGROUP = Path("/sys/fs/cgroup/memory")
HEADROOM = 512 << 20  # the runtime needs ~300 MiB beyond its slots here (reader buffers, transient copies)


def build_checkpoint(folder: Path) -> None:
    """Write the random bfloat16 Mixtral once (a `sizes.json` marker names its shape; another shape rebuilds)."""
    from fate_lab.model.testing import tiny_model
    from fate_lab.paths import EMBEDDED_MODELS

    marker = folder / "sizes.json"
    want = {**SIZES, "router_std": ROUTER_STD, "dtype": "bfloat16", "seed": 0}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        return
    if folder.exists():
        shutil.rmtree(folder)
    print(f"building the random checkpoint in {folder} (once)", flush=True)
    model = tiny_model("mixtral", seed=0, dtype=torch.bfloat16, router_std=ROUTER_STD, **SIZES)
    model.save_pretrained(folder, max_shard_size="64GB")
    del model
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODELS["tiny_moe"] / name, folder / name)
    marker.write_text(json.dumps(want))


def drop_from_page_cache(folder: Path) -> None:
    """Evict the checkpoint's clean pages (posix_fadvise DONTNEED), so the next reader starts cold."""
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_pages(file: Path) -> float:
    """Share of the file's pages in the page cache now (mincore over a private mapping that is never written)."""
    import ctypes
    import mmap

    size = file.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    with open(file, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            page = mmap.PAGESIZE
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            buf = ctypes.c_char.from_buffer(mm)
            try:
                if libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) != 0:
                    raise OSError(ctypes.get_errno(), "mincore failed")
            finally:
                del buf
            return sum(v & 1 for v in vec) / len(vec)
        finally:
            mm.close()


@torch.no_grad()
def greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[float], float, list[int]]:
    """(decode forward seconds, prefill seconds, tokens): a prefill and new_tokens - 1 greedy decode forwards."""
    t0 = time.perf_counter()
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    pre = time.perf_counter() - t0
    toks, dec = [int(out.logits[0, -1].argmax())], []
    for _ in range(new_tokens - 1):
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([[toks[-1]]]), cache=out.cache, use_cache=True)
        dec.append(time.perf_counter() - t0)
        toks.append(int(out.logits[0, -1].argmax()))
    return dec, pre, toks


def run_prompts(model, prompts, new_tokens) -> dict:
    """tok/s over every decode forward, the first prompt's TTFT, the wall time and the tokens."""
    dec, pre, toks = [], [], []
    for p in prompts:
        d, f, t = greedy(model, p, new_tokens)
        dec += d
        pre.append(f)
        toks.append(t)
    return {"tok_s": len(dec) / sum(dec), "ttft_ms": 1e3 * pre[0], "wall_s": sum(dec) + sum(pre), "tokens": toks}


# ----------------------------------------------------------------------------------------------- part 1
def part1(args, folder: Path, lines: list[str]) -> dict:
    from fate_lab import offload  # the public call: it plans the auto row first, as a user's call does
    from fate_lab.core.config import OffloadConfig
    from fate_lab.core.shape import ModelShape
    from fate_lab.model.adapters import adapt
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.models import load_model
    from fate_lab.model.record import record_trace
    from fate_lab.sim.simulate import simulate
    from fate_lab.study.whatif import checkpoint_expert_bytes, machine_hardware

    model, tok = load_model(folder, dtype=torch.bfloat16, experts_implementation="eager")
    a = adapt(model)
    shape = ModelShape.from_adapter(a)
    total = a.num_moe_layers * a.num_experts
    slots = int(total * args.share)
    file = folder / "model.safetensors"
    disk_bytes = checkpoint_expert_bytes(file)
    hw, layer_s = machine_hardware(model, tok, link="disk")
    link, c = hw.link, hw.compute
    raw_bw = link.bandwidth * disk_bytes / shape.nbytes()
    prompts = [tok(t)["input_ids"][:24] for t in heldout_prompts(args.prompts)]
    own = record_trace(model, tok, prompts, decode_tokens=args.new_tokens - 1, progress=False)
    tiny, tiny_tok = load_model("tiny_moe")
    trained = record_trace(tiny, tiny_tok, prompts, decode_tokens=args.new_tokens - 1, progress=False)
    del tiny
    expert_mb = disk_bytes / 1e6
    lines += [f"Checkpoint: {file.stat().st_size / 1e9:.2f} GB ({total} routed experts of {expert_mb:.1f} MB, "
              f"{a.num_moe_layers} layers x {a.num_experts}, top-{a.top_k}); cache {slots} slots = {args.share:.0%} of "
              f"the experts = {slots * disk_bytes / 1e9:.2f} GB.",
              f"Disk (measured now, O_DIRECT): {raw_bw / 1e9:.2f} GB/s, {link.latency * 1e3:.3f} ms per read, "
              f"{link.queue_depth} reader threads. Decode layer (all resident): {layer_s * 1e3:.2f} ms.", "",
              "Bounds per decode token: compute (all resident) "
              f"{a.num_moe_layers * layer_s * 1e3:.0f} ms; a miss costs {disk_bytes / raw_bw * 1e3:.1f} ms of disk "
              f"against {layer_s * 1e3:.1f} ms of a layer's compute, so every row that misses is disk-bound.", "",
              "## Part 1: one process, the whole model in RAM; offloaded rows read every moved expert from the disk",
              "",
              "| row | measured tok/s | predicted (own routing) | pred/meas | predicted (trained routing) | "
              "measured TTFT ms | predicted TTFT ms | decode hit rate | GB read | disk bound kept | tokens = plain |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    cfgs = {p: OffloadConfig.preset(p, link="disk", store="ssd", checkpoint=str(folder), slots=slots,
                                    layer_compute_s=layer_s) for p in PRESETS}
    runs: dict[str, list] = {"all_resident": [], **{p: [] for p in PRESETS}}
    resolved: dict[str, object] = {}
    run_prompts(model, [prompts[0][:8]], 3)  # warm-up: the first forwards allocate
    for rep in range(args.repeats):  # interleaved: every row once, then again
        r = run_prompts(model, prompts, args.new_tokens)
        r.update(bound_s=0.0, read_gb=0.0, hit=1.0)
        runs["all_resident"].append(r)
        print(f"repeat {rep + 1}: all_resident {r['tok_s']:.2f} tok/s", flush=True)
        for p, cfg in cfgs.items():
            with offload(model, cfg) as rt:
                r = run_prompts(model, prompts, args.new_tokens)
                st = rt.stats
                reads = (st.total("prefill").bytes_moved + st.total("decode").bytes_moved) / rt.expert_bytes
                resolved[p] = rt.config
                r.update(bound_s=reads * disk_bytes / raw_bw, read_gb=reads * disk_bytes / 1e9,
                         hit=st.summary()["decode"]["hit_rate"])
            runs[p].append(r)
            print(f"repeat {rep + 1}: {p} {r['tok_s']:.2f} tok/s, hit {r['hit']:.3f}", flush=True)
    plain_tokens = runs["all_resident"][0]["tokens"]
    out = {}
    for row, rs in runs.items():
        tok_s, ttft = [x["tok_s"] for x in rs], [x["ttft_ms"] for x in rs]
        mt, mf = statistics.median(tok_s), statistics.median(ttft)
        if row == "all_resident":
            cfg = OffloadConfig.preset("fate", all_resident=True, link="instant")
        else:
            cfg = resolved[row].replace()
        sim_own, sim_tr = simulate(own, cfg, hw, shape), simulate(trained, cfg, hw, shape)
        pt = 1e3 * sim_own.forward_s["prefill"][0]
        kept = all(x["wall_s"] >= x["bound_s"] for x in rs)
        same = all(x["tokens"] == plain_tokens for x in rs)
        name = row if row != "auto" else f"auto ({_differs(resolved[row], cfgs['auto'])})"
        out[row] = {"measured": mt, "predicted": sim_own.decode_tok_s, "trained": sim_tr.decode_tok_s}
        lines.append(f"| {name} | {mt:.2f} [{min(tok_s):.2f}-{max(tok_s):.2f}] | {sim_own.decode_tok_s:.2f} | "
                     f"{sim_own.decode_tok_s / mt:.2f} | {sim_tr.decode_tok_s:.2f} | {mf:.0f} [{min(ttft):.0f}-"
                     f"{max(ttft):.0f}] | {pt:.0f} | {statistics.median(x['hit'] for x in rs):.3f} | "
                     f"{statistics.median(x['read_gb'] for x in rs):.2f} | {'yes' if kept else 'NO'} | "
                     f"{'yes' if same else 'NO'} |")
        print(lines[-1], flush=True)
    if c.disk_model:  # the readers' host work and their slow-down of compute, measured apart (fit/contention.py)
        from .bench_disk import machine_line

        profile = f"This machine as the simulator saw it: {machine_line(hw, layer_s, raw_bw, shape.nbytes())}."
    else:
        profile = (f"Compute profile: link overshoot +{c.link_extra_s * 1e3:.3f} ms, per landed transfer "
                   f"+{c.landed_s * 1e3:.3f} ms, busy x{c.busy_factor:.2f}.")
    lines += ["", profile + " The trained-routing column replays the embedded "
              "tiny_moe's routing of the same prompts (its own predictions too) on this shape's timing: a "
              "prediction only, no runtime row measures a trained model of this size.", ""]
    return {"slots": slots, "expert_bytes": disk_bytes, "plain_tokens": plain_tokens, "prompts": prompts,
            "layer_s": layer_s, "resident_tok_s": out["all_resident"]["measured"],
            "disk": (raw_bw, link.latency, link.queue_depth)}


def plan_mmap(folder: Path, info: dict, page_cache_bytes: float, measured_tok_s: float) -> list[str]:
    """`plan`'s static model of the mmap row, run as the command line gives it (its disk term; the compute is
    the measured all-resident row's, since no data sheet describes this machine's CPU), with the device's
    read-ahead window and with single 4 KiB pages (the model it replaced)."""
    from fate_lab.fit.disk import readahead_of
    from fate_lab.hardware.disks import READAHEAD_BYTES
    from fate_lab.hardware.static_speed import OS_RESERVED_BYTES
    from fate_lab.study.clock import THREADS
    from fate_lab.study.fit import placement, predict_placement, setting

    bw, lat, qd = info["disk"]
    ra = readahead_of(folder / "model.safetensors") or READAHEAD_BYTES
    ram_mib = (page_cache_bytes + OS_RESERVED_BYTES) / 2**20  # plan leaves OS_RESERVED_BYTES to the OS
    out = ["", "`plan`'s static model of the mmap row (the page cache holds the same share of every expert: no "
           "routing locality; its disk term beside the measured all-resident compute, "
           f"{1e3 / info['resident_tok_s']:.1f} ms per token):", "",
           "| read-ahead window | command | page cache share | disk ms per token | predicted tok/s | measured | "
           "pred/meas |", "|---|---|---|---|---|---|---|"]
    for window in (ra, 4096):
        spec = f"bw={bw / 1e9:.3f}GBps,lat={lat * 1e6:.0f}us,qd={qd},ra={window >> 10}KiB"
        cmd = (f"plan --model {folder} --device none --cpu-only --host ddr4-3200x1,cores={THREADS} "
               f"--host-ram {ram_mib:.0f}MiB --disk {spec} --weights bf16")
        s = setting(str(folder), None, f"ddr4-3200x1,cores={THREADS}", "llama.cpp", "bf16", None,
                    f"{ram_mib:.0f}MiB", spec)
        pr = predict_placement(s, placement(cpu_only=True))
        disk_s = pr.parts_ms["disk"] / 1e3
        tok_s = 1.0 / (1.0 / info["resident_tok_s"] + disk_s)
        what = f"{window >> 10} KiB (this disk's read_ahead_kb)" if window == ra else "4 KiB (single pages)"
        out.append(f"| {what} | `{cmd}` | {pr.resident_share:.1%} | {disk_s * 1e3:.0f} | {tok_s:.2f} | "
                   f"{measured_tok_s:.2f} | {tok_s / measured_tok_s:.2f} |")
    return out


def _differs(cfg, request) -> str:
    """The fields of auto's pick that differ from its request, one level into the config's parts (its cache,
    prefetch, ... configs): what it chose."""
    out = []
    for f in dataclasses.fields(cfg):
        if f.name in ("name", "auto"):
            continue
        mine, asked = getattr(cfg, f.name), getattr(request, f.name)
        if dataclasses.is_dataclass(mine) and type(mine) is type(asked):
            out.append(_differs(mine, asked))
        elif dataclasses.is_dataclass(mine) or dataclasses.is_dataclass(asked) or mine != asked:
            # a config part (a dataclass) is never compared with a plain value: config_parts refuses that
            out.append(f"{f.name}={'(calibrated)' if f.name == 'miss_curves' else repr(mine)}")
    return ", ".join(x for x in out if x)


# ----------------------------------------------------------------------------------------------- part 2
class MmapExperts(torch.nn.Module):
    """One layer's routed experts computed straight from the memory-mapped checkpoint (llama.cpp's way): the
    weights are views of the mapping, so the OS page cache is the expert cache."""

    def __init__(self, w1: list, w2: list, w3: list):
        super().__init__()
        self.w1, self.w2, self.w3 = w1, w2, w3

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            tok, pos = torch.where(top_k_index == e)
            x = hidden_states[tok]
            h = torch.nn.functional.silu(x @ self.w1[e].T) * (x @ self.w3[e].T)
            out.index_add_(0, tok, ((h @ self.w2[e].T) * top_k_weights[tok, pos, None]).to(out.dtype))
        return out


def _mmap_model(folder: Path):
    import warnings

    import numpy as np

    from fate_lab.model.checkpoint import load_without_experts
    from fate_lab.offloading.disk import safetensors_header

    model, _, _ = load_without_experts(folder, torch.bfloat16)
    file = folder / "model.safetensors"
    start, header = safetensors_header(file)
    mm = np.memmap(file, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only mapping: torch warns that the tensors are not writable

        def view(key):
            h = header[key]
            a, b = h["data_offsets"]
            return torch.frombuffer(mm, dtype=torch.bfloat16, count=(b - a) // 2, offset=start + a).view(h["shape"])

        for i, layer in enumerate(model.model.layers):
            n = layer.mlp.experts.num_experts
            key = f"model.layers.{i}.block_sparse_moe.experts.{{}}.{{}}.weight"
            layer.mlp.experts = MmapExperts(*([view(key.format(e, w)) for e in range(n)] for w in ("w1", "w2", "w3")))
    return model


def _cg(name: str) -> Path:
    return CGROUP / name


def _child(mode: str, folder: Path, cgroup: str, budget: int, prompts: list, new_tokens: int, slots: int,
           layer_s: float) -> dict:
    """In a fresh process inside `cgroup`: set up, cap the memory at setup + budget + headroom, decode."""
    cg = _cg(cgroup)
    (cg / "cgroup.procs").write_text(str(os.getpid()))
    from fate_lab.core.config import OffloadConfig
    from fate_lab.offloading.load import load_offloaded
    from fate_lab.study.clock import pinned

    rt = None
    if mode == "mmap":
        model = _mmap_model(folder)
    else:
        cfg = OffloadConfig.preset(mode, link="disk", store="ssd", slots=slots, layer_compute_s=layer_s)
        model, _, rt = load_offloaded(folder, cfg, dtype=torch.bfloat16)
    drop_from_page_cache(folder)  # cold: the setup's reads (digests, dense tensors) leave no expert cached
    cached0 = resident_pages(folder / "model.safetensors")
    if cached0 > 0.05:
        raise RuntimeError(f"{cached0:.0%} of the checkpoint stays in the page cache after the drop: another process "
                           "maps it, so this run would not start cold")
    setup = int((cg / "memory.usage_in_bytes").read_text())
    # the same cap for every mode: the runtime's slots (the budget) are written at offload, so its setup holds them
    cap = setup + HEADROOM + (budget if mode == "mmap" else 0)
    (cg / "memory.limit_in_bytes").write_text(str(cap))
    (cg / "memory.max_usage_in_bytes").write_text("0")
    flt0 = _majflt()
    with pinned():  # the compute threads of part 1
        r = run_prompts(model, prompts, new_tokens)
    r.update(setup_mb=setup / 2**20, cap_mb=cap / 2**20, peak_mb=int((cg / "memory.max_usage_in_bytes").read_text())
             / 2**20, failcnt=int((cg / "memory.failcnt").read_text()), majflt=_majflt() - flt0,
             cached=resident_pages(folder / "model.safetensors"), cached0=cached0)
    if rt is not None:
        r["hit"] = rt.stats.summary()["decode"]["hit_rate"]
        rt.close()
    return r


def _majflt() -> int:
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[9])


def part2(args, folder: Path, info: dict, lines: list[str]) -> None:
    lines += ["## Part 2: a process whose memory is capped below the model", ""]
    name = f"fate_lab_bench_{os.getpid()}"
    try:
        _cg(name).mkdir()
    except OSError as exc:
        lines += [f"Not run: this machine gives no writable memory cgroup ({CGROUP}: {exc}), so no memory cap can "
                  "be set on a child process.", ""]
        return
    budget = info["slots"] * int(info["expert_bytes"])
    modes = ["mmap", "lru", "fate"]
    runs: dict[str, list] = {m: [] for m in modes}
    try:
        for rep in range(args.cap_repeats):
            for m in modes:
                cmd = [sys.executable, "-m", "benchmarks.bench_big_disk", "--child", m, "--dir", str(folder),
                       "--child-args", json.dumps({"cgroup": name, "budget": budget, "prompts": info["prompts"],
                                                   "new_tokens": args.new_tokens, "slots": info["slots"],
                                                   "layer_s": info["layer_s"]})]
                p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
                if p.returncode != 0:
                    raise RuntimeError(f"the {m} child failed (exit {p.returncode}): {p.stderr[-2000:]}")
                r = json.loads(p.stdout.strip().splitlines()[-1])
                runs[m].append(r)
                print(f"capped repeat {rep + 1}: {m} {r['tok_s']:.2f} tok/s, peak {r['peak_mb']:.0f} of cap "
                      f"{r['cap_mb']:.0f} MB", flush=True)
    finally:
        _cg(name).rmdir()
    lines += [f"Cap per child: its memory after setup + the cache budget ({budget / 2**20:.0f} MiB, {info['slots']} "
              f"experts) + {HEADROOM >> 20} MiB; page-cache pages count against it (cgroup v1 memory controller).", "",
              "| row | measured tok/s | TTFT ms | setup MiB | cap MiB | peak MiB | major faults | checkpoint "
              "pages cached at the end | tokens = plain |", "|---|---|---|---|---|---|---|---|---|"]
    label = {"mmap": "mmap, page cache as the expert cache (llama.cpp's way)",
             "lru": "load_offloaded + lru, link=disk", "fate": "load_offloaded + fate, link=disk"}
    for m, rs in runs.items():
        tok_s = [x["tok_s"] for x in rs]
        same = all(x["tokens"] == info["plain_tokens"] for x in rs)
        med = {k: statistics.median(x[k] for x in rs) for k in ("ttft_ms", "setup_mb", "cap_mb", "peak_mb",
                                                                 "majflt", "cached")}
        lines.append(f"| {label[m]} | {statistics.median(tok_s):.2f} [{min(tok_s):.2f}-{max(tok_s):.2f}] | "
                     f"{med['ttft_ms']:.0f} | {med['setup_mb']:.0f} | {med['cap_mb']:.0f} | {med['peak_mb']:.0f} | "
                     f"{med['majflt']:.0f} | {med['cached']:.1%} | {'yes' if same else 'NO'} |")
    mm = runs["mmap"]
    page_cache = statistics.median((x["cap_mb"] - x["setup_mb"]) * 2**20 for x in mm)
    lines += plan_mmap(folder, info, page_cache, statistics.median(x["tok_s"] for x in mm))
    lines.append("")


def main(argv: list[str] | None = None) -> str | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/fate_lab_big_mixtral"),
                    help="where the random checkpoint is built once (default %(default)s)")
    ap.add_argument("--share", type=float, default=0.25, help="share of the experts in the cache (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of part 1 (default %(default)s)")
    ap.add_argument("--cap-repeats", type=int, default=2, help="interleaved repeats of part 2 (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts per run (default %(default)s)")
    ap.add_argument("--no-cap", action="store_true", help="skip part 2")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-args", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kw = json.loads(args.child_args)
        print(json.dumps(_child(args.child, args.dir, **kw)))
        return None
    if not 0 < args.share < 1:
        raise SystemExit(f"--share {args.share}: a share of the experts between 0 and 1")
    from fate_lab.study.clock import THREADS, pinned

    from .report import emit

    build_checkpoint(args.dir)
    t0 = time.time()
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    lines = [f"# A model larger than its RAM budget, streamed from this machine's disk ({time.strftime('%Y-%m-%d')})",
             "", f"`python -m benchmarks.bench_big_disk {shlex.join(argv if argv is not None else sys.argv[1:])}`",
             "", f"Machine load (1/5/15 min) at start: {' '.join(load0)}; torch {torch.__version__}, "
             f"{THREADS} compute thread(s) in every row. {args.prompts} held-out prompts x {args.new_tokens} tokens "
             "per run; measured: median [min-max] over the repeats.", ""]
    torch.manual_seed(0)
    with pinned():
        info = part1(args, args.dir, lines)
    gc.collect()  # part 1's model maps the checkpoint: unmapped, its pages can leave the page cache
    if not args.no_cap:
        part2(args, args.dir, info, lines)
    load1 = Path("/proc/loadavg").read_text().split()[:3]
    lines += [f"Machine load at the end: {' '.join(load1)}. Wall time {time.time() - t0:.0f} s."]
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
