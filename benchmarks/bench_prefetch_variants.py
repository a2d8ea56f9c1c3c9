"""Which prefetch mechanism pays, over link speeds: the simulator's sweep behind the `fate` preset.

For transfer/compute ratios r (one expert's transfer time / one decode layer's compute time)
from 0.25 to 4, simulates decode tok/s of the ablation ladder and the prefetch variants on a
trace of the embedded model: uniform LRU -> ARC -> shallow-favoring allocation -> cross-layer
top-k prefetch -> 75th percentile (`fate_v1`: the whole set queued, admitted on
load) -> link-sized prefetch -> admitted on use (`fate`), plus the two-mechanism crosses. Two
compute profiles: the estimated RTX 3090 one (a GPU: no CPU-emulation costs) and this machine's,
calibrated from the runtime. Speed is reported relative to uniform LRU in the same cell.

    python -m benchmarks.bench_prefetch_variants --out benchmarks/results/prefetch_variants_$(date +%F).md
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time

import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.fit.calibrate import calibrate_compute
from fate_lab.hardware.links import LinkProfile
from fate_lab.hardware.profiles import COMPUTE_PROFILES
from fate_lab.hardware.setups import Hardware
from fate_lab.model.adapters import adapt
from fate_lab.model.record import record_trace
from fate_lab.policy.rules import TopK
from fate_lab.sim.simulate import simulate

RATIOS = [0.25, 0.5, 1.0, 2.0, 2.9, 4.0]


def ladder(top_k: int) -> dict[str, OffloadConfig]:
    """The ablation ladder and the variants, as configs (budget set per cell)."""
    lru = OffloadConfig.preset("lru")
    arc = lru.replace(name="arc", replacement="arc")
    shallow = arc.replace(name="arc+shallow", allocation="shallow")
    fate = OffloadConfig.preset("fate")
    v1 = OffloadConfig.preset("fate_v1")
    return {
        "lru": lru, "arc": arc, "arc+shallow": shallow,
        "+top-k prefetch (v1 mechanics)": v1.replace(name="topk", rule=TopK(top_k)),
        "+75th percentile = fate_v1": v1,
        "+link-sized (admit on load)": v1.replace(name="link_onload", prefetch_budget="link"),
        "whole set, admit on use": v1.replace(name="all_onuse", admit_prefetch="on_use"),
        "+link-sized, admit on use = fate": fate,
        "link-sized x2 window, admit on use": fate.replace(name="w2", prefetch_window=2.0),
        "link-sized x4 window, admit on use": fate.replace(name="w4", prefetch_window=4.0),
        "fate with uniform LRU": fate.replace(name="fate_lru", allocation="uniform", replacement="lru"),
        "fate with uniform ARC": fate.replace(name="fate_uarc", allocation="uniform"),
    }


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4,
                    help="held-out prompts in the simulated trace (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens generated per prompt (default %(default)s)")
    ap.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = ap.parse_args(argv)
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.models import load_model

    t0 = time.time()
    model, tok = load_model(None)
    a = adapt(model)
    prompts = [tok(t)["input_ids"][:32] for t in heldout_prompts(args.prompts)]
    trace = record_trace(model, tok, prompts, decode_tokens=args.new_tokens - 1, progress=False)
    shape = ModelShape.from_adapter(a)
    profiles = {"RTX 3090 estimate": COMPUTE_PROFILES["qwen15_moe_rtx3090"],
                "this CPU (calibrated)": calibrate_compute(model, torch.tensor([prompts[0]]))}
    total = a.num_moe_layers * a.num_experts
    configs = ladder(a.top_k)
    lines = [f"# Prefetch variants over link speeds, simulated ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.bench_prefetch_variants {shlex.join(argv or sys.argv[1:])}`", "",
             f"Embedded model, {args.prompts} held-out prompts x {args.new_tokens} tokens. Cells: decode tok/s "
             "relative to uniform LRU in the same cell (r = one expert's transfer / one decode layer's compute); "
             "decode hit rate in brackets.", ""]
    for pname, prof in profiles.items():
        layer_s = prof.dense(1) + a.top_k * prof.expert(1) + prof.call_s + prof.predict_s
        for share in (0.5, 0.25):
            lines += [f"## {pname}, {share:.0%} of experts cached", "",
                      "| variant | " + " | ".join(f"r={r}" for r in RATIOS) + " |",
                      "|---|" + "---|" * len(RATIOS)]
            rows: dict[str, list[str]] = {n: [] for n in configs}
            for r in RATIOS:
                link = LinkProfile(f"r={r}", a.bytes_per_expert() / (r * layer_s), 0.0)
                base = None
                for name, cfg in configs.items():
                    res = simulate(trace, cfg.replace(slots=int(total * share)), Hardware(prof, link),
                                   shape)
                    base = base or res.decode_tok_s
                    rows[name].append(f"{res.decode_tok_s / base:.2f} ({res.hit_rate('decode'):.2f})")
            lines += [f"| {n} | " + " | ".join(v) + " |" for n, v in rows.items()] + [""]
            print("\n".join(lines[-len(configs) - 4:]), flush=True)
    lines.append(f"Wall time {time.time() - t0:.0f} s.")
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
