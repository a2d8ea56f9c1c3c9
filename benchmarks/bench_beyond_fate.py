"""Beyond Fate without changing a token: each lossless idea side by side with `fate` and `lru`, in one run.

Runs `fate_lab.study.beyond.side_by_side` (the table of notebook 07) on the embedded model: each config
generates the same held-out prompts through the real offloaded runtime over the scaled PCIe 3.0 link
(calibrated once), with the simulator's prediction beside it, at 25% and 50% of the experts cached.
Prints one markdown table per cache size and the targets as ratios of this run.

    python -m benchmarks.bench_beyond_fate
    python -m benchmarks.bench_beyond_fate --out benchmarks/results/beyond_fate_$(date +%F).md
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from fate_lab.core.config import OffloadConfig

from .report import emit

PRESETS = ["lru", "fate", "fate_learned", "host_compute", "static_host", "all_host"]


def configs(skip: tuple[str, ...] = ()) -> dict[str, OffloadConfig]:
    """The rows: presets plus the replacement policies beyond ARC on fate's pipeline."""
    out = {n: OffloadConfig.preset(n) for n in PRESETS if n not in skip}
    for pol in ("lrfu", "router_ema"):
        out[f"fate + {pol}"] = OffloadConfig.preset("fate", replacement=pol)
    return out


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded tiny MoE)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=3,
                    help="held-out prompts each config generates (default %(default)s)")
    ap.add_argument("--link", default="qwen15_moe_rtx3090_pcie3",
                    help="link to emulate: a setup (scaled to this machine) or a link profile, one of "
                         "fate_lab.hardware.setups.link_names() (default %(default)s)")
    ap.add_argument("--out", default=None, help="also write the tables to this markdown file")
    ap.add_argument("--skip", nargs="*", default=[], help="presets to leave out")
    args = ap.parse_args(argv)
    from fate_lab.model.adapters import adapt
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.models import load_model
    from fate_lab.study.beyond import markdown, side_by_side

    torch.manual_seed(0)
    model, tok = load_model(args.model)
    a = adapt(model)
    total = a.num_moe_layers * a.num_experts
    t0 = time.time()
    lines = [f"# Beyond Fate, lossless ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.bench_beyond_fate {shlex.join(argv or sys.argv[1:])}`", "",
             f"Model: {args.model or 'embedded tiny MoE'}; {args.prompts} held-out prompts x {args.new_tokens} "
             f"tokens; link {args.link} (scaled, calibrated once); host profile desktop_ddr4.", ""]
    tables = {}
    for share in (0.25, 0.5):
        df = side_by_side(model, tok, heldout_prompts(args.prompts), configs(tuple(args.skip)), link=args.link,
                          slots=int(total * share), new_tokens=args.new_tokens)
        tables[share] = df
        lines += [f"## {share:.0%} of the experts cached ({int(total * share)} slots)", "",
                  markdown(df), ""]
        print("\n".join(lines[-3:]), flush=True)
    q, h = (t["decode tok/s"] for t in (tables[0.25], tables[0.5]))
    same = bool(all(all(t["same tokens as plain"]) for t in tables.values()))
    lines += ["Targets, runtime, decode tok/s ratios of this run:", "",
              f"- host_compute / fate at 25%: {q['host_compute'] / q['fate']:.2f}x "
              "(target >= 1.5x)",
              f"- host_compute / fate at 50%: {h['host_compute'] / h['fate']:.2f}x",
              f"- every row keeps the plain model's tokens: {same}",
              f"\nWall time {time.time() - t0:.0f} s."]
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
