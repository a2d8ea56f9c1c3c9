"""Published absolute speeds of offloaded MoE inference beside fate_lab's prediction for the same setup.

For every published figure whose setup is stated and whose time follows from bytes and FLOPs alone
(load-on-demand of a token's own top-k, all experts on the host) -- and one Fate figure that depends on the
routing, run on an embedded model's routing on the setup's clock -- the sizing tool's prediction: the model
from its published config (data/configs, built on the meta device), the device from its data sheet
(fate_lab/hardware/devices.py), the link and host from theirs, the simulator over a stand-in routing
(for these presets the routing does not matter: every decode token moves or computes its own top-k).
The figures and their sources come from docs/published/published.json. Every difference over 30% is
explained in the table's last column.

    python -m benchmarks.bench_published            # writes docs/published_vs_predicted.md
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.costs import compute_for
from fate_lab.hardware.links import LINK_PROFILES
from fate_lab.hardware.setups import Hardware, HostRef
from fate_lab.sim.simulate import simulate
from fate_lab.study.plan import model_spec, standin_trace

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "docs" / "published" / "published.json"


@dataclasses.dataclass(frozen=True)
class Case:
    """One published figure and the setup fate_lab predicts it on."""

    key: tuple[str, str]  # (id, system) in published.json
    model: str  # data/configs name
    device: str
    link: str
    preset: str
    quant: str | None = None  # the experts' precision on the GPU / link
    host: str = "desktop_ddr4"
    host_bits: float | None = None  # bits per expert weight a host computes from (a GGUF/MXFP4 file), None: 16
    note: str = ""  # why a difference over 30% is what it is


CASES = [
    *[Case(("mixtral_offloading_wo_%s_%s" % (b, g), "mixtral-offloading: W/o LRU cache & pre-loading"),
           "Mixtral-8x7B-v0.1", dev, link, "load_on_demand", q,
           note=f"our {q} experts are {qb} bits a weight against their {tb}; each on-demand load in their code "
                "costs a fixed overhead the bytes alone do not show (their per-expert rows reach under half the "
                "bandwidth of their whole-layer rows on the same GPU)")
      for b, q, qb, tb in (("2bit", "int2", 3.0, "~2.6"), ("3bit", "int3", 3.5, "~3.3"))
      for g, dev, link in (("T4", "t4", "pcie3_x16_cloud"), ("3060", "rtx3060", "pcie3_x16"),
                           ("A100", "a100_80gb", "pcie4_x16_cloud"))],
    Case(("ktransformers_v02_single_socket_8", "kTransformers V0.2 - single socket, 8 experts"), "DeepSeek-V3", "rtx4090", "pcie4_x16", "all_host",
         host="xeon_gold_6454s", host_bits=4.5,
         note="Q4_K_M experts (4.5 bits) on one Xeon Gold 6454S socket; our host streams at 0.5 of its DRAM peak"),
    Case(("ik_llama_gptoss120b_4080_5975wx", "ik_llama.cpp, -ngl 100 -ot exps=CPU (all routed-expert weights and "
          "biases on CPU)"), "gpt-oss-120b", "rtx4080", "pcie4_x16", "all_host",
         host="threadripper_pro_5975wx", host_bits=4.25,
         note="MXFP4 experts (4.25 bits) on the CPU; their kernel reaches ~0.23 of the DRAM peak where we assume "
              "0.5"),
]


def _value(entry: dict, field: str = "decode") -> float:
    v = entry["value"]
    if isinstance(v, dict):
        for k in v:
            if k.lower().startswith(field) or "generation" in k.lower():
                return float(v[k])
        raise KeyError(f"no {field} figure in {entry['id']}: {list(v)}")
    return float(v)


def predict(case: Case, fast: bool) -> tuple[float, str]:
    """(predicted decode tok/s, the hardware in words) for one case."""
    spec = model_spec(case.model, torch.float16)
    shape = spec.shape
    compute = compute_for(shape, case.device, case.host, spec.vocab_size, spec.tied, context=256)
    host_ref = None
    if case.host_bits is not None:  # the host computes from a quantized file: fewer bytes per expert
        b = int(shape.nbytes(None) * case.host_bits / 16)
        host_ref = HostRef(b, shape.expert_flops(), 1.0)
    hw = Hardware(compute, LINK_PROFILES[case.link], host_ref)
    cfg = OffloadConfig.preset(case.preset, quant=case.quant, host_profile=case.host, context_len=256)
    res = simulate(standin_trace(shape, fast=fast), cfg, hw, shape)
    return res.decode_tok_s, f"{case.device} over {case.link}" + (f", host {case.host}" if case.preset != "load_on_demand"
                                                                  else "")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "published_vs_predicted.md"), help="markdown file to write")
    ap.add_argument("--full", action="store_true", help="the full-size stand-in routing (slower; same figures for "
                    "these routing-independent presets)")
    args = ap.parse_args(argv)
    figures = json.loads(PUBLISHED.read_text())["figures"]
    by_key = {(f["id"], f["system"]): f for f in figures}
    lines = [f"# Published offloading speeds beside fate_lab's predictions ({time.strftime('%Y-%m-%d')})", "",
             "`python -m benchmarks.bench_published` (figures and sources: `docs/published/published.json`; every "
             "prediction from the model's published config, the device's data sheet, the link and host profiles, "
             "the roofline and the simulator; batch 1, decode).", "",
             "| figure | system | model | setup | published tok/s | predicted tok/s | predicted / published | "
             "why they differ (where > 30%) | source |", "|---|---|---|---|---|---|---|---|---|"]
    for case in CASES:
        entry = by_key[case.key]
        pub = _value(entry)
        pred, setup = predict(case, fast=not args.full)
        ratio = pred / pub
        why = case.note if abs(ratio - 1) > 0.3 else "within 30%"
        lines.append(f"| {case.key[0]} | {case.key[1]} | {case.model} ({case.preset}"
                     f"{', ' + case.quant if case.quant else ''}) | {setup} | {pub:.3g} | {pred:.3g} | {ratio:.2f} | "
                     f"{why} | {entry['source'][:90]} |")
        print(lines[-1], flush=True)
    lines += ["", "Not predicted here (their figures depend on routing, and these models' routing is not available "
              "offline): the Fate paper's absolute rates (a secondary summary gives ~14 decode tok/s for "
              "Qwen1.5-MoE on an RTX 3090 over PCIe 3.0), mixtral-offloading's full algorithm, Fiddler, MoE-Infinity."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
