"""`auto` against every named preset: the simulator grid (setups x budgets x models) and the runtime on this machine.

Grid (simulator, default): for each embedded model, named setup (`hardware.setups.SETUPS`, each on its own clock
with its GPU compute profile) and cache size (10/25/50% of the experts, in slots), every named preset and the
planner's `auto` / `auto_quant`, all scored on the EVAL split; the planner decides from the first prompts of the
CALIBRATION split only. Targets: auto >= 0.98x the best lossless named preset and auto_quant >= 0.98x
the best quantized one in every cell, and >= 1.05x the best named preset in at least a third of the cells.

Runtime (`--runtime`): the real runtime on this machine (CPU; emulated scaled links), tiny_moe, 25% and 50% of
the experts on the scaled RTX 3090 PCIe 3.0 and 4.0 links, torch pinned to one thread; each config `--repeats`
times (the spread is reported), `auto` resolved by `offload` itself (a short calibration on this machine), its
tokens checked against the plain model's.

    python -m benchmarks.bench_auto --out benchmarks/results/auto_$(date +%F).md
    python -m benchmarks.bench_auto --runtime --out benchmarks/results/auto_runtime_$(date +%F).md
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.setups import SETUPS, Hardware
from fate_lab.model.adapters import adapt
from fate_lab.sim.simulate import simulate
from fate_lab.study import lab
from fate_lab.study.auto import LOSSLESS_START, QUANT_START, describe_config, plan_auto

GRID_SETUPS = ("qwen15_moe_rtx3090_pcie3", "qwen15_moe_rtx3090_pcie4", "qwen15_moe_laptop4060_pcie4x8",
               "deepseek_moe_1080ti_pcie1")
SHARES = (0.1, 0.25, 0.5)
MODELS = ("tiny_moe", "tiny_deepseek")
RUNTIME_LINKS = ("qwen15_moe_rtx3090_pcie3", "qwen15_moe_rtx3090_pcie4")
RUNTIME_LOSSLESS = ("lru", "mixtral_offloading", "activation_path", "eap", "fate", "fate_v1", "fate_learned",
                    "host_compute", "static_host", "all_host")


def grid_cell(model: str, setup: str, share: float, ev, ca, shape: ModelShape) -> dict:
    """Every preset and both plans in one (model, setup, share) cell: decode tok/s on the eval split."""
    slots = int(shape.num_moe_layers * shape.num_experts * share)
    hw = Hardware.scaled(setup)
    row = {"model": model, "setup": setup, "share": share, "slots": slots}
    for name in ("all_resident",) + LOSSLESS_START + QUANT_START:
        row[name] = simulate(ev, OffloadConfig.preset(name, slots=slots), hw, shape).decode_tok_s
    for req in ("auto", "auto_quant"):
        t0 = time.time()
        plan = plan_auto(ca, shape, hw, OffloadConfig.preset(req, slots=slots))
        row[req] = simulate(ev, plan.config, hw, shape).decode_tok_s
        row[f"{req} pick"] = plan.describe()
        row[f"{req} calib best"] = plan.scores[0][1]
        row[f"{req} plan s"] = time.time() - t0
    return row


def grid(args) -> str:
    done = {}
    ckpt = Path(args.checkpoint)
    if ckpt.is_file():
        for line in ckpt.read_text().splitlines():
            r = json.loads(line)
            done[r["model"], r["setup"], r["share"]] = r
    t0 = time.time()
    for model in args.models:
        ev = lab.get_trace(model, fast=False, split="eval")
        ca = lab.get_trace(model, fast=False, split="calib")
        ca = ca.subset(ca.prompt_id < args.calib_prompts)
        shape = ModelShape.from_adapter(adapt(lab.load(model)[0]))
        for setup in args.setups:
            for share in SHARES:
                if (model, setup, share) in done:
                    continue
                row = grid_cell(model, setup, share, ev, ca, shape)
                done[model, setup, share] = row
                with ckpt.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{model} {setup} {share:.0%}: auto {row['auto']:.1f} ({row['auto pick']}); auto_quant "
                      f"{row['auto_quant']:.1f}", flush=True)
    rows = [done[m, s, sh] for m in args.models for s in args.setups for sh in SHARES]
    return grid_report(rows, args, time.time() - t0)


def grid_report(rows: list[dict], args, wall: float) -> str:
    lossless = [n for n in LOSSLESS_START]
    quant = list(QUANT_START)
    head = ["model", "setup", "cached"] + lossless + ["**auto**", "auto / best lossless"] + quant + \
        ["**auto_quant**", "auto_quant / best quant", "best named (any)", "best auto / best named"]
    lines = [f"# `auto` against every named preset, simulated ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.bench_auto {shlex.join(sys.argv[1:])}`", "",
             "Decode tok/s predicted by the timed simulator on the EVAL split of each embedded model (held-out "
             "prompts x 96 greedy tokens), on each named setup's own clock and GPU compute profile "
             "(`Hardware.scaled(setup)`); cache size in slots (share of all routed experts; staging buffers apart). "
             f"`auto` / `auto_quant` were planned from the first {args.calib_prompts} prompts of the CALIBRATION "
             "split only (`fate_lab.study.auto.plan_auto`). Bold: the plans; ratios against the best named preset "
             "of the same kind in the same cell.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    r_l, r_q, r_any = [], [], []
    for r in rows:
        bl = max(r[n] for n in lossless)
        bq = max(r[n] for n in quant)
        best_named = max(bl, bq)
        best_auto = max(r["auto"], r["auto_quant"])
        r_l.append(r["auto"] / bl)
        r_q.append(r["auto_quant"] / bq)
        r_any.append(best_auto / best_named)
        cells = [r["model"], r["setup"], f"{r['share']:.0%}"] + [f"{r[n]:.1f}" for n in lossless] + \
            [f"**{r['auto']:.1f}**", f"{r_l[-1]:.2f}"] + [f"{r[n]:.1f}" for n in quant] + \
            [f"**{r['auto_quant']:.1f}**", f"{r_q[-1]:.2f}", f"{best_named:.1f}", f"{r_any[-1]:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    n = len(rows)
    wins_l = sum(x >= 1.05 for x in r_l)
    wins_q = sum(x >= 1.05 for x in r_q)
    lines += ["", "## Targets", "",
              f"- auto >= 0.98x the best lossless named preset in every cell: min {min(r_l):.3f} "
              f"({'met' if min(r_l) >= 0.98 else 'NOT met'}; {sum(x < 0.98 for x in r_l)} of {n} cells below)",
              f"- auto_quant >= 0.98x the best quantized named preset in every cell: min {min(r_q):.3f} "
              f"({'met' if min(r_q) >= 0.98 else 'NOT met'}; {sum(x < 0.98 for x in r_q)} of {n} cells below)",
              f"- >= 1.05x the best named preset of its kind in at least a third of the cells: auto {wins_l}/{n}, "
              f"auto_quant {wins_q}/{n} ({'met' if max(wins_l, wins_q) * 3 >= n else 'NOT met'}); the better plan "
              f">= 1.05x the best named preset of either kind: {sum(x >= 1.05 for x in r_any)}/{n}",
              f"- geometric means: auto / best lossless {statistics.geometric_mean(r_l):.2f}x, auto_quant / best "
              f"quant {statistics.geometric_mean(r_q):.2f}x"]
    stretch = [r for r in rows if r["setup"] == "qwen15_moe_rtx3090_pcie3" and r["share"] == 0.5]
    for r in stretch:
        lines.append(f"- stretch, {r['model']} on the RTX 3090 / PCIe 3.0 setup at 50%: auto_quant "
                     f"{r['auto_quant']:.1f} tok/s vs all-resident {r['all_resident']:.1f}: "
                     f"{r['all_resident'] / r['auto_quant']:.2f}x slower "
                     f"({'met' if r['all_resident'] <= 2 * r['auto_quant'] else 'not met'})")
    lines += ["", "## What each plan picked", "", "| model | setup | cached | auto | auto_quant |",
              "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['setup']} | {r['share']:.0%} | {r['auto pick']} | {r['auto_quant pick']} |")
    lines.append(f"\nWall time {wall:.0f} s (this run; cells already in the checkpoint are not re-timed).")
    return "\n".join(lines)


# --- the runtime on this machine ---------------------------------------------------------------------------------
@torch.no_grad()
def _greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    toks = []
    for _ in range(new_tokens - 1):
        nxt = out.logits[:, -1:].argmax(-1)  # (1, 1)
        toks.append(int(nxt))
        out = model(input_ids=nxt, cache=out.cache, use_cache=True)
    toks.append(int(out.logits[:, -1:].argmax(-1)))
    return toks


def _measure(model, prompts, cfg: OffloadConfig, new_tokens: int, repeats: int) -> dict:
    """Median decode tok/s of `repeats` runs (2 prompts each, after a warm-up), their spread and the tokens."""
    from fate_lab import offload  # plans an auto request first

    rates, tokens = [], None
    with offload(model, cfg) as rt:
        _greedy(model, prompts[0], 4)
        for _ in range(repeats):
            rt.reset_stats()
            tokens = [_greedy(model, p, new_tokens) for p in prompts]
            dec = rt.stats.forward_s["decode"]
            rates.append(len(dec) / sum(dec))
        picked = rt.config
    med = statistics.median(rates)
    return {"tok_s": med, "spread": (max(rates) - min(rates)) / med, "tokens": tokens, "config": picked}


def runtime(args) -> str:
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.offloading.runtime import calibrate_layer_time

    torch.set_num_threads(1)
    model, tok = lab.load("tiny_moe")
    a = adapt(model)
    prompts = [tok(t)["input_ids"][:24] for t in heldout_prompts(args.prompts)]
    plain = [_greedy(model, p, args.new_tokens) for p in prompts]
    layer_s = calibrate_layer_time(model, steps=24)
    total = a.num_moe_layers * a.num_experts
    t0 = time.time()
    lines = [f"# `auto` in the runtime on this machine ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.bench_auto {shlex.join(sys.argv[1:])}`", "",
             f"tiny_moe, {args.prompts} held-out prompts x {args.new_tokens} greedy tokens, torch on one thread, "
             f"scaled links on one calibrated layer time ({layer_s * 1e3:.3f} ms); decode tok/s is the median of "
             f"{args.repeats} runs, spread = (max - min) / median. `auto` / `auto_quant` are resolved by `offload` "
             "itself (its own short calibration on this machine: layer time, compute profile, a calibration-split "
             "trace of 2 prompts x 12 tokens).", "",
             "| link | cached | config | decode tok/s | spread | same tokens as plain | what auto picked |",
             "|---|---|---|---|---|---|---|"]
    summary = []
    for link in RUNTIME_LINKS:
        for share in (0.25, 0.5):
            slots = int(total * share)
            res = {}
            for name in RUNTIME_LOSSLESS + QUANT_START + ("auto", "auto_quant"):
                cfg = OffloadConfig.preset(name, slots=slots, link=link, layer_compute_s=layer_s)
                r = _measure(model, prompts, cfg, args.new_tokens, args.repeats)
                res[name] = r
                pick = describe_config(r["config"]) if name.startswith("auto") else ""
                lines.append(f"| {link} | {share:.0%} | {name} | {r['tok_s']:.1f} | {r['spread']:.0%} | "
                             f"{r['tokens'] == plain} | {pick} |")
                print(lines[-1], flush=True)
            bl = max(RUNTIME_LOSSLESS, key=lambda n: res[n]["tok_s"])
            bq = max(QUANT_START, key=lambda n: res[n]["tok_s"])
            noise = max(res[n]["spread"] for n in (bl, bq, "auto", "auto_quant"))
            summary.append(f"- {link}, {share:.0%}: auto {res['auto']['tok_s']:.1f} vs best lossless {bl} "
                           f"{res[bl]['tok_s']:.1f} = {res['auto']['tok_s'] / res[bl]['tok_s']:.2f}x (exact tokens: "
                           f"{res['auto']['tokens'] == plain}); auto_quant {res['auto_quant']['tok_s']:.1f} vs best "
                           f"quantized {bq} {res[bq]['tok_s']:.1f} = "
                           f"{res['auto_quant']['tok_s'] / res[bq]['tok_s']:.2f}x; largest spread of these four rows "
                           f"{noise:.0%}")
    lines += ["", "## Targets (runtime)", ""] + summary + [f"\nWall time {time.time() - t0:.0f} s."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runtime", action="store_true", help="the runtime table instead of the simulator grid")
    ap.add_argument("--models", nargs="+", default=list(MODELS),
                    help="embedded models of the simulator grid (default: tiny_moe tiny_deepseek)")
    ap.add_argument("--setups", nargs="+", default=list(GRID_SETUPS), choices=sorted(SETUPS),
                    help="named setups of the simulator grid, each on its own clock "
                         "(default: RTX 3090 PCIe 3.0/4.0, laptop 4060, 1080 Ti)")
    ap.add_argument("--calib-prompts", type=int, default=6, help="calibration-split prompts the planner reads")
    ap.add_argument("--checkpoint", default="results/auto_grid.jsonl", help="finished cells (resumed from)")
    ap.add_argument("--prompts", type=int, default=2,
                    help="held-out prompts per runtime run (--runtime; default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=32,
                    help="greedy tokens decoded per prompt (--runtime; default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each runtime config; the median counts (--runtime; default %(default)s)")
    ap.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = ap.parse_args(argv)
    Path(args.checkpoint).parent.mkdir(parents=True, exist_ok=True)
    text = runtime(args) if args.runtime else grid(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
