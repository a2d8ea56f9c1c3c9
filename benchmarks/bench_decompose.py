"""The decomposition table: each regime's speed-up over load-on-demand split into what each component contributes.

Simulator (`fate_lab.study.decompose.decompose`): both embedded models, transfer/compute ratios 0.25-4, 10/25/50%
cached, full precision and Fate's INT4/INT2, the RTX 3090 compute profile, the first `--prompts` prompts of the
EVAL split; factors multiply to the total (prediction split into ceiling, lateness, recall and precision with
the oracle / filtered counterfactuals). Runtime (`decompose_runtime`, unless `--no-runtime`): the same ladder
measured on this machine at two points (tiny_moe; RTX 3090 PCIe 3.0 scaled at 25%, PCIe 4.0 at 50%) beside the
simulator's prediction on this machine's calibrated compute profile.

    python -m benchmarks.bench_decompose --out benchmarks/results/decompose_$(date +%F).md
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from fate_lab.core.shape import ModelShape
from fate_lab.model.adapters import adapt
from fate_lab.study import lab
from fate_lab.study.decompose import decompose, decompose_runtime, plot_decomposition, wide

RUNTIME_POINTS = (("qwen15_moe_rtx3090_pcie3", 0.25), ("qwen15_moe_rtx3090_pcie4", 0.5))


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny_moe", "tiny_deepseek"],
                    help="embedded models the simulator decomposes (default: tiny_moe tiny_deepseek)")
    ap.add_argument("--prompts", type=int, default=6, help="eval-split prompts simulated per regime")
    ap.add_argument("--no-runtime", action="store_true", help="skip the runtime points (simulator only)")
    ap.add_argument("--no-sim", action="store_true", help="only the runtime points")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runtime runs per config; the median counts (default %(default)s)")
    ap.add_argument("--out", default=None,
                    help="also write the report to this markdown file (with a CSV and PNG plots beside it)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    stamp = time.strftime("%Y-%m-%d")
    lines = [f"# The decomposition: what each component contributes ({stamp})", "",
             f"`python -m benchmarks.bench_decompose {shlex.join(argv or sys.argv[1:])}`", "",
             "Factors are speed ratios of one ladder step over the previous (`fate_lab.study.decompose`): cache = "
             "uniform LRU over load-on-demand; allocation = Fate's shallow-favoring split; replacement = ARC; "
             "prediction = `fate` (cross-layer gate, 75th percentile, link-sized x4, staged until used), split into "
             "ceiling (all stall removed) x lateness (what a perfect predictor still waits for) x recall x precision "
             "(counterfactual runs with an oracle and with fate's sets filtered to the used experts); then "
             "quantization (`fate_quant` over `fate`) or host compute (`host_compute` over `fate`). The factors of a "
             "row multiply to its total. Simulator, RTX 3090 compute profile, decode tok/s on the first "
             f"{args.prompts} prompts of each model's EVAL split.", ""]
    frames = []
    for model in [] if args.no_sim else args.models:
        ev = lab.get_trace(model, fast=False, split="eval")
        ev = ev.subset(ev.prompt_id < args.prompts)
        shape = ModelShape.from_adapter(adapt(lab.load(model)[0]))
        df = decompose(ev, shape, model, progress=False)
        frames.append(df)
        for precision in ("fp", "int4/int2"):
            w = wide(df[df["precision"] == precision]).drop(columns=["model", "precision"])
            lines += [f"## {model}, {precision}", ""] + _markdown(w) + [""]
            if args.out:
                fig = plot_decomposition(df, model, precision)
                png = Path(args.out).with_name(f"decompose_{stamp}_{model}_{precision.replace('/', '_')}.png")
                fig.savefig(png, dpi=90, bbox_inches="tight")
                lines += [f"![{model} {precision}]({png.name})", ""]
        net = df[df["component"].str.startswith("prediction")].groupby(["ratio", "cached"])["log2 factor"].sum()
        pays = [f"r={r:g}/{s:.0%}" for (r, s), v in net.items() if 2 ** v >= 1.05]
        lines += [f"Prediction's net factor (the four parts together) is >= 1.05x in: {', '.join(pays) or 'no regime'}"
                  f"; its largest is {2 ** net.max():.2f}x and smallest {2 ** net.min():.2f}x.", ""]
    if args.out and frames:
        import pandas as pd

        pd.concat(frames).to_csv(Path(args.out).with_suffix(".csv"), index=False)
    if not args.no_runtime:
        model, tok = lab.load("tiny_moe")
        rt = decompose_runtime(model, tok, RUNTIME_POINTS, repeats=args.repeats)
        lines += ["## Runtime on this machine at two points (tiny_moe)", "",
                  f"2 held-out prompts x 32 greedy tokens, torch on one thread, median of {args.repeats} runs "
                  "(spread = (max - min) / median); simulated = the simulator on this machine's compute profile "
                  "calibrated from the runtime (quantized rows: on the plain model's routing). Factors as above, "
                  "per step.", ""]
        lines += _markdown(rt.round(3)) + [""]
    lines.append(f"Wall time {time.time() - t0:.0f} s.")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return text


def _markdown(df) -> list[str]:
    cols = list(df.columns)
    out = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        cells = []
        for c, v in zip(cols, row, strict=True):
            if c == "cached":
                cells.append(f"{v:.0%}")
            elif isinstance(v, float):
                cells.append(f"{v:.2f}")
            else:
                cells.append(str(v))
        out.append("| " + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    main()
