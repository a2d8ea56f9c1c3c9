"""Quality for speed: drop / substitute / commit at several thresholds against fate and the quantized presets.

Runs `fate_lab.study.quality.sweep_lossy` on the embedded model at 25% of the experts cached over the scaled
PCIe 3.0 link (calibrated once): each row decodes the same held-out text token by token through the real
runtime, so its decode tok/s and its quality (perplexity change, greedy agreement, KL to the plain model)
come from the same steps. Prints a markdown table and the targets.

    python -m benchmarks.bench_lossy --out benchmarks/results/lossy_$(date +%F).md
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

from .report import emit

THRESHOLDS = {"drop": [0.05, 0.1, 0.2], "substitute": [0.05, 0.1, 0.2], "commit": [0.3, 0.5, 0.7],
              "standin": [0, 4, 16]}  # standin: the recurrence window in decode calls


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128, help="held-out text tokens decoded per config")
    ap.add_argument("--link", default="qwen15_moe_rtx3090_pcie3",
                    help="link to emulate: a setup (scaled to this machine) or a link profile, one of "
                         "fate_lab.hardware.setups.link_names() (default %(default)s)")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    from fate_lab.model.models import load_model
    from fate_lab.study.beyond import markdown
    from fate_lab.study.quality import sweep_lossy

    t0 = time.time()
    model, tok = load_model()
    slots = model.config.num_hidden_layers * model.config.num_experts // 4
    df = sweep_lossy(model, tok, THRESHOLDS, link=args.link, slots=slots, n_tokens=args.tokens)
    ok = df[(df["perplexity change"] <= 0.01) & (df["greedy agreement"] >= 0.9)]
    lines = [f"# Quality for speed ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.bench_lossy {shlex.join(argv or sys.argv[1:])}`", "",
             f"Embedded model, {slots} slots (25%), link {args.link}; {args.tokens} held-out tokens decoded one by "
             "one per row (perplexity change and greedy agreement vs the plain model on them) plus 2 prompts x 16 "
             "teacher-forced decode steps.", "", markdown(df.set_index("policy")), "",
             "Targets: a setting with perplexity change <= 1% and agreement >= 90% decoding >= 1.3x fate:"]
    for kind in THRESHOLDS:
        k = ok[ok["policy"] == kind]
        best = k.loc[k["speed vs fate"].idxmax()] if len(k) else None
        lines.append(f"- {kind}: " + ("no threshold within the quality bounds" if best is None else
                     f"threshold {best['threshold']}: {best['speed vs fate']:.2f}x fate, "
                     f"ppl {best['perplexity change']:+.2%}, "
                     f"agreement {best['greedy agreement']:.1%}"))
    lines.append(f"\nWall time {time.time() - t0:.0f} s.")
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
