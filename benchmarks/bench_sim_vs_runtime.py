"""Simulator vs runtime: predicted and measured decode speed of every preset, in one run.

For each scaled link and budget, runs the real offloaded runtime (greedy, prefill + N-1 decode
forwards per prompt) and `fate_lab.sim.simulate` on a trace of the same prompts, with the link
calibrated ONCE at start-up and shared by every row (so no two rows run over different links), and
the compute profile measured anew before each link x budget block (the machine drifts). Prints one
markdown table: measured and predicted decode tok/s, their ratio, stall per decode token, decode hit
rate, and the targets (fate vs lru and load_on_demand; fate_quant vs lru_quant, runtime only: a
quantized model routes differently from the trace of the plain one, so the simulator is not asked
about it).

    python -m benchmarks.bench_sim_vs_runtime                 # embedded model, 2 prompts x 32 tokens
    python -m benchmarks.bench_sim_vs_runtime --out benchmarks/results/sim_vs_runtime.md
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
from fate_lab.hardware.setups import run_hardware
from fate_lab.model.adapters import adapt
from fate_lab.model.record import record_trace
from fate_lab.offloading.runtime import calibrate_layer_time, offload
from fate_lab.sim.simulate import simulate
from fate_lab.study.whatif import calibration_ids

from .bench_prefetch_variants import ladder
from .report import emit

PRESETS = ["all_resident", "load_on_demand", "lru", "mixtral_offloading", "activation_path", "eap", "fate_v1", "fate",
           "host_compute", "static_host", "all_host"]
ABLATION = ["arc", "arc+shallow", "+top-k prefetch (v1 mechanics)", "whole set, admit on use",
            "fate with uniform ARC"]  # rows of bench_prefetch_variants.ladder, measured in the runtime too
QUANT = ["lru_quant", "fate_quant"]
LINKS = ["qwen15_moe_rtx3090_pcie3", "qwen15_moe_rtx3090_pcie4"]


@torch.no_grad()
def greedy(model, prompt: list[int], new_tokens: int) -> None:
    """Prefill + new_tokens - 1 greedy decode forwards (what record_trace records). The prefill computes the logits
    of its last position only, as `generate` does (and the calibration, which times `generate`): the head over every
    prompt position cost 1.6-1.9 ms more per 24-token prefill on the embedded models, which no user call pays."""
    out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    for _ in range(new_tokens - 1):
        out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=out.cache, use_cache=True)


def run_runtime(model, prompts, cfg, new_tokens) -> dict:
    """Measured decode tok/s, TTFT (the first prompt's prefill), stall per decode token and hit rate of one
    config, from a runtime that starts with an empty cache as the simulator does (the warm-up runs in one of
    its own)."""
    with offload(model, cfg):
        greedy(model, prompts[0][:8], 4)  # warm-up: the first forwards allocate
    with offload(model, cfg) as rt:
        for p in prompts:
            greedy(model, p, new_tokens)
        s = rt.stats.summary()
        dec = rt.stats.forward_s["decode"]
        ttft = rt.stats.forward_s["prefill"][0]
    return {"tok_s": len(dec) / sum(dec), "ttft_ms": 1e3 * ttft, "stall_ms": 1e3 * s["decode"]["stall_s"] / len(dec),
            "hit": s["decode"]["hit_rate"], "link": rt.stats.link}


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the embedded tiny MoE)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts per row (default %(default)s)")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    from fate_lab.study.clock import pinned

    torch.manual_seed(0)
    with pinned():  # torch's threads pinned for the calibration and every run alike
        return _run(args, argv)


def _run(args, argv) -> str:
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.models import load_model

    model, tok = load_model(args.model)
    a = adapt(model)
    prompts = [tok(t)["input_ids"][:24] for t in heldout_prompts(args.prompts)]
    t0 = time.time()
    layer_s = calibrate_layer_time(model, steps=24)  # the scaled links' clock: once, so every row has the same link

    def measure():  # the machine's compute profile now (a prompt as long as the measured ones: linear slopes)
        return calibrate_compute(model, calibration_ids(tok, len(prompts[0])), new_tokens=24, link=LINKS[0],
                                 layer_compute_s=layer_s)

    compute = measure()
    denses = []
    trace = record_trace(model, tok, prompts, decode_tokens=args.new_tokens - 1, progress=False)
    shape = ModelShape.from_adapter(a)
    total = a.num_moe_layers * a.num_experts
    lines = [f"# Simulator vs runtime ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.bench_sim_vs_runtime {shlex.join(argv or sys.argv[1:])}`", "",
             f"Model: {args.model or 'embedded tiny MoE'}; {args.prompts} held-out prompts x {args.new_tokens} tokens; "
             f"layer time {layer_s * 1e3:.3f} ms (calibrated once); "
             f"compute profile: dense {compute.dense_s * 1e3:.3f} ms/layer, "
             f"expert {compute.expert_s * 1e3:.3f} ms, call {compute.call_s * 1e3:.3f} ms, "
             f"predict {compute.predict_s * 1e3:.3f} ms, cold expert +{compute.expert_cold_s * 1e3:.3f} ms, "
             f"per landed transfer +{compute.landed_s * 1e3:.3f} ms, "
             f"link overshoot +{compute.link_extra_s * 1e3:.3f} ms, "
             f"wake-up {compute.wake_s * 1e3:.3f} ms, busy link x{compute.busy_factor:.2f}, per queued transfer "
             f"+{compute.transfer_host_s * 1e3:.3f} ms (CPU emulation costs, see hardware.compute.ComputeProfile). "
             "The compute profile is measured anew before each link x budget block, since this shared machine's speed "
             "drifts within minutes (the figures above: the first block's; the dense layer over the blocks: DENSES). "
             "Every runtime row starts with an empty cache, as the simulator does; TTFT is the first prompt's prefill.",
             "", "| link | cached | preset | runtime tok/s | simulated tok/s | sim/runtime | runtime TTFT ms | "
             "sim TTFT ms | sim/runtime TTFT | runtime stall ms/tok | sim stall ms/tok | runtime hit | sim hit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios: dict = {}
    for link_name in LINKS:
        for share in (0.5, 0.25):
            if denses:  # the first block uses the profile measured above
                compute = measure()
            denses.append(compute.dense_s)
            slots = int(total * share)
            lad = ladder(a.top_k)
            for name in PRESETS + ABLATION + QUANT:
                base = lad[name] if name in lad else OffloadConfig.preset(name)
                cfg = base.replace(link=link_name, slots=slots, layer_compute_s=layer_s)
                r = run_runtime(model, prompts, cfg, args.new_tokens)
                ratios[link_name, share, name] = r["tok_s"]
                if name in QUANT:
                    lines.append(f"| {link_name} | {share:.0%} | {name} | {r['tok_s']:.1f} | — | — | "
                                 f"{r['ttft_ms']:.0f} | — | — | {r['stall_ms']:.2f} | — | {r['hit']:.3f} | — |")
                    continue
                sim = simulate(trace, cfg, run_hardware(link_name, layer_s, compute), shape)
                sd = sim.summary()["decode"]
                n_dec = len(sim.forward_s["decode"])
                sim_ttft = 1e3 * sim.forward_s["prefill"][0]
                ratios["sim", link_name, share, name] = (sim.decode_tok_s / r["tok_s"], sim_ttft / r["ttft_ms"])
                lines.append(f"| {link_name} | {share:.0%} | {name} | {r['tok_s']:.1f} | {sim.decode_tok_s:.1f} | "
                             f"{sim.decode_tok_s / r['tok_s']:.2f} | {r['ttft_ms']:.0f} | {sim_ttft:.0f} | "
                             f"{sim_ttft / r['ttft_ms']:.2f} | {r['stall_ms']:.2f} | "
                             f"{1e3 * sd['stall_s'] / n_dec:.2f} | {r['hit']:.3f} | {sd['hit_rate']:.3f} |")
                print(lines[-1], flush=True)
    lines = [line.replace("DENSES", f"{min(denses) * 1e3:.3f}-{max(denses) * 1e3:.3f} ms") for line in lines]
    sim_rows = [v for k, v in ratios.items() if k[0] == "sim"]
    dec_r, ttft_r = [d for d, _ in sim_rows], [t for _, t in sim_rows]
    within = sum(abs(d - 1) <= 0.10 for d in dec_r), sum(abs(t - 1) <= 0.10 for t in ttft_r)
    lines += ["", f"Simulator / runtime over the {len(sim_rows)} simulated rows: "
              f"decode {min(dec_r):.2f}–{max(dec_r):.2f}x "
              f"({within[0]} within 10%), TTFT {min(ttft_r):.2f}–{max(ttft_r):.2f}x ({within[1]} within 10%)."]
    lines += ["", "Targets, runtime, ratios of decode tok/s in this run:", ""]
    for link_name in LINKS:
        for share in (0.5, 0.25):
            g = {n: ratios[link_name, share, n] for n in ("fate", "lru", "load_on_demand", "fate_v1", "fate_quant",
                                                          "lru_quant")}.get
            lines.append(f"- {link_name}, {share:.0%} cached: fate/lru {g('fate') / g('lru'):.2f}x, "
                         f"fate/load_on_demand {g('fate') / g('load_on_demand'):.2f}x, "
                         f"fate/fate_v1 {g('fate') / g('fate_v1'):.2f}x, "
                         f"fate_quant/lru_quant {g('fate_quant') / g('lru_quant'):.2f}x")
    lines.append(f"\nWall time {time.time() - t0:.0f} s.")
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
