"""Fate against EAP: routing statistics of both embedded models, and where (if anywhere) fate wins by a margin.

Three parts, all on the EVAL split of each embedded model (the calibration split only seeds the profiled EAP):
1. routing statistics (`fate_lab.study.routing_stats`): layer-to-layer transition entropy and mutual information
   (what an activation-path predictor can know from the current token's path), reuse distance (what a cache
   rewards), and decode recall of the cross-layer gate against the token-level activation path and the
   request-level activation matrix at the same set size;
2. a simulator sweep over transfer/compute ratios 0.25-4 and 10/25/50% cached (RTX 3090 compute profile): fate,
   the two EAP baselines (`activation_path`: token-level, online; `eap`: MoE-Infinity's request-level
   activation matrices), LRU, and the quantized fate the paper's headline runs (`fate_quant`) against `eap` with
   and without the same quantization;
3. the paper's two named setups (RTX 3090 / PCIe 3.0 with Qwen1.5-MoE's clock, GTX 1080 Ti / PCIe 1.0 with
   DeepSeek-MoE's), 25% cached.

    python -m benchmarks.bench_fate_vs_eap --out benchmarks/results/fate_vs_eap_$(date +%F).md
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.profiles import COMPUTE_PROFILES
from fate_lab.hardware.setups import Hardware
from fate_lab.model.adapters import adapt
from fate_lab.policy.predictors import activation_matrices
from fate_lab.sim.simulate import simulate
from fate_lab.study import lab
from fate_lab.study.decompose import ratio_hardware
from fate_lab.study.routing_stats import predictor_recall, reuse_distance, transition_entropy

RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0)
SHARES = (0.1, 0.25, 0.5)
PAPER_SETUPS = ("qwen15_moe_rtx3090_pcie3", "deepseek_moe_1080ti_pcie1")


def configs(seed: tuple) -> dict[str, OffloadConfig]:
    """The contenders: fate, both EAP baselines (the request-level one also profiled on the calibration split),
    LRU, and the quantized pairs."""
    eap = OffloadConfig.preset("eap")
    return {"lru": OffloadConfig.preset("lru"), "activation_path": OffloadConfig.preset("activation_path"),
            "eap": eap, "eap (profiled)": eap.replace(activation_collection=seed),
            "fate": OffloadConfig.preset("fate"), "fate_quant": OffloadConfig.preset("fate_quant"),
            "eap_quant": eap.replace(name="eap_quant", quant="fate")}


def _md(df, floatfmt: str = ".3f") -> list[str]:
    cols = list(df.columns)
    out = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    for r in df.itertuples(index=False):
        out.append("| " + " | ".join(f"{v:{floatfmt}}" if isinstance(v, float) else str(v) for v in r) + " |")
    return out


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny_moe", "tiny_deepseek"],
                    help="embedded models to compare on (default: tiny_moe tiny_deepseek)")
    ap.add_argument("--prompts", type=int, default=8, help="eval-split prompts simulated in the sweep")
    ap.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.time()
    lines = [f"# Fate against EAP ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.bench_fate_vs_eap {shlex.join(argv or sys.argv[1:])}`", ""]
    comp = COMPUTE_PROFILES["qwen15_moe_rtx3090"]
    for model in args.models:
        ev = lab.get_trace(model, fast=False, split="eval")
        ca = lab.get_trace(model, fast=False, split="calib")
        shape = ModelShape.from_adapter(adapt(lab.load(model)[0]))
        E = shape.num_experts
        te = transition_entropy(ev.experts, E)
        rd = reuse_distance(ev.experts, E, ev.prompt_id, ev.phase)
        pr = predictor_recall(ev, shape, ca)
        lines += [f"## {model} ({shape.num_moe_layers} MoE layers x {E} experts, top-{shape.top_k})", "",
                  "Transition entropy (mean over layer pairs, bits): "
                  f"H(next) {te['H(next) bits'].mean():.2f} of {te['uniform bits'].iloc[0]:.2f} uniform, "
                  f"H(next | current) {te['H(next | current) bits'].mean():.2f}, mutual information "
                  f"{te['mutual information bits'].mean():.2f} ({te['share of H(next) explained'].mean():.1%} of "
                  "H(next)).", "",
                  "Reuse distance (decode uses, mean over layers): reused by the next token "
                  f"{rd['reused next token'].mean():.1%}, within 4 tokens {rd['reused within 4'].mean():.1%}, within "
                  f"16 {rd['reused within 16'].mean():.1%}, never again in the prompt {rd['never again'].mean():.1%}; "
                  f"median distance {rd['median distance (reused)'].median():g} tokens.", ""]
        lines += _md(pr) + [""]
        sub = ev.subset(ev.prompt_id < args.prompts)
        seed = tuple(tuple(tuple(float(x) for x in row) for row in m)
                     for m in activation_matrices(ca.experts, ca.prompt_id, E).tolist())
        cfgs = configs(seed)
        head = ["ratio", "cached"] + list(cfgs) + ["fate / eap", "fate / activation_path", "fate / best EAP",
                                                   "fate_quant / eap", "fate_quant / eap_quant"]
        lines += [f"Simulated decode tok/s, {args.prompts} eval prompts, {comp.name} compute:", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        best = (0.0, None)
        for r in RATIOS:
            hw, hwq = ratio_hardware(shape, comp, r), ratio_hardware(shape, comp, r, "fate")
            for share in SHARES:
                slots = int(shape.num_moe_layers * E * share)
                v = {n: simulate(sub, c.replace(slots=slots), hwq if c.quant else hw, shape).decode_tok_s
                     for n, c in cfgs.items()}
                beap = max(v["activation_path"], v["eap"], v["eap (profiled)"])
                ratios = [v["fate"] / v["eap"], v["fate"] / v["activation_path"], v["fate"] / beap,
                          v["fate_quant"] / v["eap"], v["fate_quant"] / v["eap_quant"]]
                if ratios[2] > best[0]:
                    best = (ratios[2], (r, share))
                lines.append("| " + " | ".join([f"{r:g}", f"{share:.0%}"] + [f"{v[n]:.1f}" for n in cfgs]
                                               + [f"{x:.2f}" for x in ratios]) + " |")
        lines += ["", f"Largest fate / best EAP baseline (same precision): {best[0]:.2f}x at r={best[1][0]:g}, "
                      f"{best[1][1]:.0%} cached.", "", "Named setups (each on its own clock), 25% cached:", "",
                  "| setup | " + " | ".join(cfgs) + " | fate / best EAP | fate_quant / eap |",
                  "|---|" + "---|" * (len(cfgs) + 2)]
        for s in PAPER_SETUPS:
            hw = Hardware.scaled(s)
            slots = int(shape.num_moe_layers * E * 0.25)
            v = {n: simulate(sub, c.replace(slots=slots), hw, shape).decode_tok_s for n, c in cfgs.items()}
            beap = max(v["activation_path"], v["eap"], v["eap (profiled)"])
            lines.append(f"| {s} | " + " | ".join(f"{v[n]:.1f}" for n in cfgs) +
                         f" | {v['fate'] / beap:.2f} | {v['fate_quant'] / v['eap']:.2f} |")
        lines.append("")
        print("\n".join(lines), flush=True)
    lines.append(f"Wall time {time.time() - t0:.0f} s.")
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
