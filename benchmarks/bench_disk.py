"""The simulator against a physical link: experts read from this machine's disk (link="disk"), predicted vs measured.

For each model, cache share and preset, runs the real offloaded runtime with `link="disk"` (every transfer an
O_DIRECT read of the checkpoint, so no row is served by the page cache; each row offloads anew, so its slots
start empty) and `fate_lab.simulate` on a trace of the same prompts, with this machine's Hardware from
`machine_hardware(model, tok, link="disk", fresh=True)` (compute calibrated from the runtime, the disk measured with
O_DIRECT reads, the readers' host work and their contention with compute measured apart: `fit/contention.py`); a
quantized preset's row from a calibration of its own, with the experts packed as it packs them
(`machine_hardware(..., quant=cfg.quant)`).
Repeats are rounds: each measures the machine anew, then runs every row once and predicts it from that measurement,
since this shared machine's speed drifts by 10-20% within minutes (5 rounds by default: with 3, a row's rounds predicted
each other within 10% in only 44-48 of 54 rows for TTFT, with 5 in 54); the table gives the median and the spread
(min-max) of the measured and predicted figures, and the median of each round's own ratio. Each run is checked against
the disk's bound: it cannot take less time than the checkpoint bytes it read at the O_DIRECT bandwidth measured in its
round. `lru_quant` and `fate_quant`
read the packed copies they write to a file once (fate_lab's cache folder) from the same disk, so their rows
move fewer bytes per load; the packing happens at offload, before the timed run.

    python -m benchmarks.bench_disk --fast        # tiny_moe; lru, fate, load_on_demand; 25% cached; 5 rounds
    python -m benchmarks.bench_disk --out benchmarks/results/disk_$(date +%F).md
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.model.adapters import adapt
from fate_lab.model.record import record_trace
from fate_lab.offloading.runtime import offload
from fate_lab.sim.simulate import simulate
from fate_lab.study.whatif import checkpoint_expert_bytes, machine_hardware

from .bench_sim_vs_runtime import greedy  # one loop for both benchmarks
from .report import emit

PRESETS = ["load_on_demand", "lru", "mixtral_offloading", "activation_path", "eap", "fate_v1", "fate", "lru_quant",
           "fate_quant"]  # the quantized ones read their packed copies from a file written once
FAST_PRESETS = ["load_on_demand", "lru", "fate"]


def run_runtime(model, prompts, cfg, new_tokens, disk_bytes: float, bandwidth: float) -> dict:
    """One cold run: decode tok/s, TTFT, and the disk bound (seconds the bytes read need at `bandwidth`)."""
    with offload(model, cfg) as rt:
        for p in prompts:
            greedy(model, p, new_tokens)
        st = rt.stats
        dec, pre = st.forward_s["decode"], st.forward_s["prefill"]
        reads = (st.total("prefill").bytes_moved + st.total("decode").bytes_moved) / rt.expert_bytes
    return {"tok_s": len(dec) / sum(dec), "ttft_ms": 1e3 * pre[0], "wall_s": sum(dec) + sum(pre),
            "bound_s": reads * disk_bytes / bandwidth, "hit": st.summary()["decode"]["hit_rate"]}


def _spread(xs: list[float]) -> str:
    """'median [min-max]'."""
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"


def _oracle(xs: list[float]) -> float:
    """The median over rounds of (the median of the other rounds' measurements) / (this round's): the pred/meas a
    predictor would score that knew every other round of the row, i.e. what this machine's noise alone allows."""
    if len(xs) < 2:
        return float("nan")
    return statistics.median(statistics.median(xs[:i] + xs[i + 1:]) / x for i, x in enumerate(xs))


def _within(ratios: list[float], tol: float = 0.10) -> int:
    """How many ratios lie within tol of 1."""
    return sum(abs(r - 1) <= tol for r in ratios)


def _table(path: str) -> dict[tuple[str, str, str], list[float]]:
    """The rows of a table this benchmark wrote: (model, cached, preset) -> [measured tok/s, predicted tok/s, measured
    TTFT, predicted TTFT] (the medians)."""
    rows, model = {}, None
    with open(path) as f:
        for line in f:
            if line.startswith("## "):
                model = line[3:].strip()
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and len(cells) == 10 and cells[0].endswith("%"):
                rows[model, cells[0], cells[1]] = [float(cells[i].split()[0]) for i in (2, 3, 5, 6)]
    if not rows:
        raise ValueError(f"{path}: no row of a bench_disk table found")
    return rows


def compare(a: str, b: str) -> str:
    """How often two tables of this benchmark agree within 10% in each column, over the rows both hold."""
    ta, tb = _table(a), _table(b)
    keys = sorted(set(ta) & set(tb))
    if not keys:
        raise ValueError(f"{a} and {b} share no row")
    lines = [f"{len(keys)} rows in both {a} and {b}:"]
    for i, col in enumerate(("measured tok/s", "predicted tok/s", "measured TTFT", "predicted TTFT")):
        r = [ta[k][i] / tb[k][i] for k in keys]
        lines.append(f"  {col}: within 10% in {_within(r)} of {len(keys)} rows ({min(r):.2f}-{max(r):.2f}x)")
    print("\n".join(lines))
    return "\n".join(lines)


def machine_line(hw, layer_s: float, raw_bw: float, nbytes: int) -> str:
    """One round's measured machine, in words: the disk, a layer, a read's host work (of nbytes), the readers'
    slow-downs and how much their reads overlap (x1: one at a time)."""
    c, link = hw.compute, hw.link
    line = (f"disk {raw_bw / 1e9:.2f} GB/s and {link.latency * 1e3:.3f} ms per read, layer {layer_s * 1e3:.3f} ms")
    if c.disk_model:
        line += (f", a read's host work {c.read_host(nbytes, False) * 1e3:.3f} ms alone / "
                 f"{c.read_host(nbytes, True) * 1e3:.3f} ms beside compute, compute x"
                 + "/".join(f"{f:.2f}" for f in c.reader_slowdown) + " (dense x"
                 + "/".join(f"{f:.2f}" for f in c.reader_slowdown_dense) + ") with 1/2 readers busy, reads overlapping"
                 f" x{c.reader_overlap:.2f}")
    return line


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", action="store_true", help="one model, three presets, 25%% cached")
    ap.add_argument("--models", nargs="*", default=None, help="embedded models (default: both; --fast: tiny_moe)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats of every row (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=24, help="tokens generated per prompt (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts per row (default %(default)s)")
    ap.add_argument("--presets", nargs="*", default=None, help="presets to run (default: all of PRESETS; --fast: "
                    "three)")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    ap.add_argument("--compare", nargs=2, metavar=("A.md", "B.md"), default=None,
                    help="run nothing: how often two earlier tables of this benchmark agree with each other within "
                         "10%%, row by row, in each measured and predicted column (the machine's run-to-run noise)")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    from fate_lab.study.clock import pinned

    torch.manual_seed(0)
    with pinned():
        return _run(args, argv)


def _run(args, argv) -> str:
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.models import load_model
    from fate_lab.paths import model_dir

    models = args.models or (["tiny_moe"] if args.fast else ["tiny_moe", "tiny_deepseek"])
    presets = args.presets or (FAST_PRESETS if args.fast else PRESETS)
    shares = (0.25,) if args.fast else (0.1, 0.25, 0.5)
    t0 = time.time()
    with open("/proc/loadavg") as f:
        load0 = f.read().split()[:3]
    lines = [f"# Experts from this machine's disk: simulator vs runtime ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.bench_disk {shlex.join(argv or sys.argv[1:])}`", "",
             f"Machine load (1/5/15 min) at start: {' '.join(load0)}. {args.prompts} held-out prompts x "
             f"{args.new_tokens} tokens per run; {args.repeats} rounds, each measuring the machine "
             "(`machine_hardware(..., fresh=True)`; the quantized rows' with their experts packed, `quant=`) and then "
             "running every row once, cold; measured and predicted: "
             "median [min-max] over the rounds; pred/meas: the median of each round's own ratio (this shared machine's "
             "speed drifts by 10-20% within minutes).", ""]
    rows: list[tuple] = []
    for name in models:
        model, tok = load_model(name)
        a = adapt(model)
        shape = ModelShape.from_adapter(a)
        disk_bytes = checkpoint_expert_bytes(model_dir(name) / "model.safetensors")
        prompts = [tok(t)["input_ids"][:24] for t in heldout_prompts(args.prompts)]
        trace = record_trace(model, tok, prompts, decode_tokens=args.new_tokens - 1, progress=False)
        total = a.num_moe_layers * a.num_experts
        keys = [(share, p) for share in shares for p in presets]

        def configs(layer_s: float, name=name, total=total, keys=keys) -> dict:
            return {(share, p): OffloadConfig.preset(p, link="disk", store="ssd", checkpoint=str(model_dir(name)),
                                                     slots=int(total * share), layer_compute_s=layer_s)
                    for share, p in keys}

        with offload(model, configs(1e-3)[keys[0]]):
            greedy(model, prompts[0][:8], 4)  # warm-up: the first forwards allocate
        runs: dict = {k: [] for k in keys}
        preds: dict = {k: [] for k in keys}
        machines = []
        for _ in range(args.repeats):  # a round: the machine measured now, then every row once, each predicted
            hw, layer_s = machine_hardware(model, tok, link="disk", fresh=True)
            raw_bw = hw.link.bandwidth * disk_bytes / shape.nbytes()  # back to checkpoint bytes/s
            machines.append((hw, layer_s, raw_bw))
            cfgs = configs(layer_s)
            # a quantized row is predicted from a calibration with its experts packed as it packs them
            hws = {q: hw if q is None else machine_hardware(model, tok, link="disk", fresh=True, quant=q)[0]
                   for q in {cfg.quant for cfg in cfgs.values()}}
            for k, cfg in cfgs.items():
                runs[k].append(run_runtime(model, prompts, cfg, args.new_tokens, disk_bytes, raw_bw))
            for k, cfg in cfgs.items():
                sim = simulate(trace, cfg.replace(), hws[cfg.quant], shape)
                preds[k].append((sim.decode_tok_s, 1e3 * sim.forward_s["prefill"][0]))
        lines += [f"## {name}", "", "This machine, measured at the start of each round: " + "; ".join(
            machine_line(hw, layer_s, raw_bw, shape.nbytes()) for hw, layer_s, raw_bw in machines) + ".", "",
                  "| cached | preset | measured tok/s | predicted tok/s | pred/meas | measured TTFT ms | "
                  "predicted TTFT ms | pred/meas TTFT | hit | disk bound kept |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for share, p in keys:
            r, q = runs[share, p], preds[share, p]
            tok_s, ttft = [x["tok_s"] for x in r], [x["ttft_ms"] for x in r]
            ptok, pttft = [x[0] for x in q], [x[1] for x in q]
            dec = statistics.median(b / m for b, m in zip(ptok, tok_s, strict=True))  # each round's own ratio
            ttf = statistics.median(b / m for b, m in zip(pttft, ttft, strict=True))
            kept = all(x["wall_s"] >= x["bound_s"] for x in r)
            rows.append((dec, ttf, kept, _oracle(tok_s), _oracle(ttft)))
            lines.append(f"| {share:.0%} | {p} | {_spread(tok_s)} | {_spread(ptok)} | {dec:.2f} | {_spread(ttft)} | "
                         f"{_spread(pttft)} | {ttf:.2f} | {statistics.median(x['hit'] for x in r):.3f} | "
                         f"{'yes' if kept else 'NO'} |")
            print(lines[-1], flush=True)
        lines.append("")
    dec = [r[0] for r in rows]
    ttf = [r[1] for r in rows]
    odec, ottf = [r[3] for r in rows], [r[4] for r in rows]
    with open("/proc/loadavg") as f:
        load1 = f.read().split()[:3]
    lines += [f"Predicted / measured over {len(rows)} rows: decode {min(dec):.2f}-{max(dec):.2f}x "
              f"({_within(dec)} within 10%), TTFT {min(ttf):.2f}-{max(ttf):.2f}x "
              f"({_within(ttf)} within 10%). Disk bound kept in "
              f"{sum(r[2] for r in rows)} of {len(rows)} rows.", "",
              "The measurement's own reproducibility (the noise floor of that count): each round predicted by the "
              "median of the other rounds' measurements of its row, aggregated as above, is within 10% in "
              f"{_within(odec)} of {len(rows)} rows for decode ({min(odec):.2f}-{max(odec):.2f}x) and {_within(ottf)} "
              f"for TTFT ({min(ottf):.2f}-{max(ottf):.2f}x).", "",
              f"Machine load at the end: {' '.join(load1)}. Wall time {time.time() - t0:.0f} s."]
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
