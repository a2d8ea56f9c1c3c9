"""Replacement beyond ARC: decode hit rates of every policy, with Belady's bound, in the replay and the simulator.

Two views on the embedded model's held-out traces (calib split to choose a parameter, eval split to
report): (1) the replay of the cache alone (no prefetch), uniform slots; (2) the timed simulator running
`fate`'s whole pipeline (cross-layer prefetch, admit on use) on the RTX 3090 + PCIe 3.0 setup with
only the replacement policy changed. Belady is the offline bound (it knows each layer's future) and
exists only in the replay. A last table sweeps router_ema's `decay` in the calib replay (how its default was chosen).

    python -m benchmarks.bench_replacement --out benchmarks/results/replacement_$(date +%F).md
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

from .report import emit

POLICIES = ["lru", "lfu", "arc", "lrfu", "router_ema"]


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = ap.parse_args(argv)
    from fate_lab.core.config import OffloadConfig
    from fate_lab.core.shape import ModelShape
    from fate_lab.hardware.setups import Hardware
    from fate_lab.model.adapters import adapt
    from fate_lab.sim.replay import replay
    from fate_lab.sim.simulate import simulate
    from fate_lab.study.lab import get_trace, load

    t0 = time.time()
    model, _ = load()
    shape = ModelShape.from_adapter(adapt(model))
    hw = Hardware.scaled("qwen15_moe_rtx3090_pcie3")
    total = shape.num_moe_layers * shape.num_experts
    lines = [f"# Replacement beyond ARC ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.bench_replacement {shlex.join(argv or sys.argv[1:])}`", "",
             "Decode hit rate (share of expert uses found on the device). Replay: the cache alone, no prefetch, "
             "uniform slots. Simulator: `fate` (prefetch + admit on use, shallow allocation) with only the "
             "replacement changed, RTX 3090 + PCIe 3.0 setup; predicted decode tok/s in brackets.", "",
             "| split | cached | " + " | ".join(POLICIES) + " | belady (bound) | best - arc | belady - best |",
             "|---|---|" + "---|" * (len(POLICIES) + 3)]
    for split in ("calib", "eval"):
        trace = get_trace(split=split)
        for share in (0.25, 0.5):
            slots = int(total * share) // shape.num_moe_layers
            hit = {p: replay(trace, slots_per_layer=slots, policy=p).hit_rate("decode")
                   for p in POLICIES + ["belady"]}
            best = max(POLICIES, key=hit.get)
            lines.append(f"| {split} replay | {share:.0%} | " + " | ".join(f"{hit[p]:.3f}" for p in POLICIES)
                         + f" | {hit['belady']:.3f} | {best} {100 * (hit[best] - hit['arc']):+.1f} pts | "
                         f"{100 * (hit['belady'] - hit[best]):.1f} pts |")
            sims = {p: simulate(trace, OffloadConfig.preset("fate", slots=int(total * share), replacement=p), hw, shape)
                    for p in POLICIES}
            sh = {p: r.hit_rate("decode") for p, r in sims.items()}
            best = max(POLICIES, key=sh.get)
            lines.append(f"| {split} simulator (fate) | {share:.0%} | " + " | ".join(
                f"{sh[p]:.3f} ({sims[p].decode_tok_s:.0f})" for p in POLICIES) + f" | — | {best} "
                f"{100 * (sh[best] - sh['arc']):+.1f} pts | — |")
            print("\n".join(lines[-2:]), flush=True)
    decays = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
    trace = get_trace(split="calib")
    lines += ["", "router_ema's `decay` (calib split, replay, decode hit rate; the default is 0.9):", "",
              "| cached | " + " | ".join(f"decay {d:g}" for d in decays) + " | best |",
              "|---|" + "---|" * (len(decays) + 1)]
    for share in (0.25, 0.5):
        slots = int(total * share) // shape.num_moe_layers
        hit = {d: replay(trace, slots_per_layer=slots, policy="router_ema", policy_kw={"decay": d}).hit_rate("decode")
               for d in decays}
        lines.append(f"| {share:.0%} | " + " | ".join(f"{hit[d]:.3f}" for d in decays)
                     + f" | {max(decays, key=hit.get):g} |")
        print(lines[-1], flush=True)
    lines.append(f"\nWall time {time.time() - t0:.0f} s.")
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
