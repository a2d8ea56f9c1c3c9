"""`python -m fate_lab plan`: its arguments, the one function that answers them, and how the answer prints.

What it is: `add_plan_parser(sub)` (every flag, with help), `answer(args)` -> a plain dict (the same for the
printout, `--json` and `benchmarks/bench_published.py`, which runs each published figure as one such command),
and `run_plan(args)`. Three questions, by the flags given:
  * a placement (`--n-cpu-moe N`, `--cpu-moe`, `-ngl N`, `--cpu-only`): its memory and predicted speed on the
    `--engine` (llama.cpp by default), from the file's `--weights` format; no trace;
  * `--fit`: every `--n-cpu-moe` and `-ngl` predicted, what fits, the llama.cpp flags, fate_lab beside them;
  * neither: fate_lab's runtime presets through the timed simulator (a trace, or a stand-in routing).
What it is not: the sizing itself (`study/fit.py`, `study/plan.py`).
"""
from __future__ import annotations

import argparse
import json

PLACEMENT_FLAGS = ("n_cpu_moe", "cpu_moe", "n_gpu_layers", "cpu_only")
STATIC_ONLY = {"weights": "--weights", "expert_weights": "--expert-weights", "engine": "--engine",
               "host_ram": "--host-ram", "disk": "--disk", "gpus": "--gpus", "prompt": "--prompt"}
PRESETS_ONLY = {"trace": "--trace", "presets": "--presets", "link": "--link"}


def add_plan_parser(sub) -> None:
    """The `plan` sub-command and its flags."""
    from fate_lab.study.plan import DEFAULT_PRESETS

    pl = sub.add_parser("plan", help="size a deployment: what fits and how fast, from a config and data-sheet specs "
                        "(llama.cpp placements, --fit, or fate_lab's runtime presets)")
    pl.add_argument("--model", required=True, help="embedded model (tiny_moe, tiny_deepseek), a published model of "
                    "data/configs (e.g. Qwen3-30B-A3B, DeepSeek-V3, gpt-oss-120b), a checkpoint folder or a "
                    "config.json")
    pl.add_argument("--device", required=True, help="a device name (rtx3090, rtx4090, dgx_spark, ...; 'none' for a "
                    "machine without one) or a spec mem=20GiB,bw=800GBps,fp16=103TFLOPS")
    pl.add_argument("--gpus", type=str, default=None, help="identical cards splitting the layers (default 1)")
    pl.add_argument("--budget", default=None, help="device memory to use, e.g. 12GiB (default: all of it)")
    pl.add_argument("--context", type=str, default="4096", help="tokens of KV cache to reserve")
    pl.add_argument("--prompt", type=str, default=None, help="prompt tokens of the predicted prefill (default 512)")
    pl.add_argument("--weights", default=None, help="the file's weight format: bf16, fp16, fp8, int8, int4_awq, "
                    "int4_gptq, mxfp4, mxfp4_moe, q8_0, q6_k, q5_k_m, q4_k_m, q4_0, q3_k_m, q2_k, hqq4, "
                    "mixtral_offloading_2bit, mixtral_offloading_3bit, fate_int4, fate_int2 (default: what the "
                    "config declares, else bf16)")
    pl.add_argument("--expert-weights", default=None, help="another format for the routed experts alone")
    pl.add_argument("--n-cpu-moe", type=str, default=None, help="llama.cpp: routed experts of the first N layers "
                    "on the CPU")
    pl.add_argument("--cpu-moe", action="store_true", help="llama.cpp: every routed expert on the CPU")
    pl.add_argument("-ngl", "--n-gpu-layers", type=str, default=None, help="llama.cpp: the last N layers on the "
                    "GPU, the rest (attention too) on the CPU")
    pl.add_argument("--cpu-only", action="store_true", help="run on the CPU alone")
    pl.add_argument("--fit", action="store_true", help="what fits with a 1 GiB margin: every --n-cpu-moe and "
                    "-ngl predicted, the largest context, the llama.cpp flags, fate_lab beside them")
    pl.add_argument("--engine", default=None, help="llama.cpp (default), ktransformers or fate_lab: kernel "
                    "efficiencies and per-call costs (fate_lab.hardware.engines)")
    pl.add_argument("--host", default="desktop_ddr4", help="the host: a name (epyc_7773x, xeon_gold_6454s, ...) or "
                    "ddr4-3200x2 / ddr5-4800x12,sockets=2,cores=32,ram=768GiB (channels and cores per socket)")
    pl.add_argument("--host-ram", default=None, help="host RAM, e.g. 64GiB: CPU-placed weights beyond it stream "
                    "from --disk")
    pl.add_argument("--disk", default=None, help="where weights beyond RAM come from: nvme, nvme_gen4, nvme_gen5, "
                    "sata_ssd, hdd, or bw=3.5GBps,lat=100us,qd=32")
    pl.add_argument("--link", default=None, help="runtime presets: the host-to-device link (default: the device's)")
    pl.add_argument("--trace", default=None, help="runtime presets: a routing trace of this model (python -m "
                    "fate_lab trace); default: the model's own (embedded) or a stand-in")
    pl.add_argument("--presets", default=None, help="runtime presets to compare, comma-separated (default: "
                    + ",".join(DEFAULT_PRESETS) + ")")
    pl.add_argument("--json", action="store_true", help="print the answer as strict JSON (missing values null)")
    pl.set_defaults(func=run_plan)


INT_FLAGS = {"gpus": "--gpus", "context": "--context", "prompt": "--prompt", "n_cpu_moe": "--n-cpu-moe",
             "n_gpu_layers": "-ngl"}


def whole(text: str | int | None, flag: str) -> int | None:
    """A command-line count: '4096', '32k' or '1e5' when it is a whole number (one clear line otherwise)."""
    if text is None or isinstance(text, int):
        return text
    t = str(text).strip().lower()
    mult = 1024 if t.endswith("k") else 1
    try:
        v = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        v = float("nan")
    if not (v == v and abs(v) < 2**62 and v == int(v)):
        raise ValueError(f"{flag} {text!r}: give a whole number, e.g. 4096 or 32k")
    return int(v)


def _ints(args: argparse.Namespace) -> None:
    for key, flag in INT_FLAGS.items():
        setattr(args, key, whole(getattr(args, key), flag))


def _mode(args: argparse.Namespace) -> str:
    placed = [f for f in PLACEMENT_FLAGS if getattr(args, f) not in (None, False)]
    if args.fit and placed:
        raise ValueError(f"--fit searches the placements itself; leave out --{placed[0].replace('_', '-')}")
    mode = "fit" if args.fit else "placement" if placed else "presets"
    wrong = PRESETS_ONLY if mode != "presets" else STATIC_ONLY
    for key, flag in wrong.items():
        if getattr(args, key) is not None:
            other = "the runtime presets (no placement flag, no --fit)" if mode != "presets" else \
                "a placement (--n-cpu-moe, --cpu-moe, -ngl, --cpu-only) or --fit"
            raise ValueError(f"{flag} applies to {other}; this plan is {mode}")
    return mode


def setting_of(args: argparse.Namespace):
    """The `study.fit.Setting` the flags describe (placements and --fit)."""
    from fate_lab.study.fit import setting

    _ints(args)
    return setting(args.model, args.device, args.host, args.engine or "llama.cpp", args.weights,
                   args.expert_weights, args.host_ram, args.disk, None, args.gpus or 1, args.context,
                   args.prompt or 512, args.budget)


def answer(args: argparse.Namespace) -> dict:
    """The plan the flags ask for, as plain values (None where a number cannot be given)."""
    from fate_lab.study.fit import fit, placement, predict_placement
    from fate_lab.study.plan import _finite, plan

    _ints(args)
    mode = _mode(args)
    if mode == "presets":
        presets = tuple(p for p in (args.presets or "").split(",") if p) or None
        kw = {"presets": presets} if presets else {}
        p = plan(args.model, args.device, args.budget, args.link, args.context, args.trace, host=args.host, **kw)
        return {"mode": mode, **p.as_dict()}
    s = setting_of(args)
    head = {"mode": mode, "setting": s.describe(), "format": s.fmt.name, "engine": s.engine.name,
            "layers": s.spec.params.n_layers}
    if mode == "placement":
        pl = placement(args.n_cpu_moe, args.cpu_moe, args.n_gpu_layers, args.cpu_only)
        return _finite({**head, "prediction": predict_placement(s, pl).row()})
    r = fit(s)
    return _finite({**head, "best": r.best.row() if r.best else None,
                    "smallest --n-cpu-moe that fits": r.best_n_cpu_moe,
                    "largest -ngl that fits": r.best_ngl, "largest context": r.max_context,
                    "fate_lab on the same placement": r.fate_lab.row() if r.fate_lab else None,
                    "n_cpu_moe": [dict(x.row(), n=k) for k, x in enumerate(r.n_cpu_moe)],
                    "ngl": [dict(x.row(), n=k) for k, x in enumerate(r.ngl)]})


def _fmt(v, nd: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}g}"
    return str(v)


def _print_static(a: dict) -> None:
    print(a["setting"])
    if a["mode"] == "placement":
        r = a["prediction"]
        print(f"llama.cpp flags: {r['flags']}")
        print(f"device memory {r['GPU (GiB)']:.2f} GiB, host RAM {r['host RAM (GiB)']:.2f} GiB")
        if not r["fits"]:
            print(f"does not fit: {r['why not']}")
            return
        print(f"decode {_fmt(r['decode tok/s'])} tok/s ({r['decode bound']}), prefill {_fmt(r['prefill tok/s'])} "
              f"tok/s, TTFT {_fmt(r['TTFT (ms)'])} ms")
        return
    b = a["best"]
    if b is None:
        print("nothing fits: every --n-cpu-moe and -ngl needs more device memory than the card has (1 GiB kept "
              "free), or more host RAM than given with no --disk")
        return
    print(f"fits: smallest --n-cpu-moe {_fmt(a['smallest --n-cpu-moe that fits'])}, largest -ngl "
          f"{_fmt(a['largest -ngl that fits'])}, largest context at the best {_fmt(a['largest context'])} tokens")
    print(f"best: {b['flags']}  decode {_fmt(b['decode tok/s'])} tok/s ({b['decode bound']}), prefill "
          f"{_fmt(b['prefill tok/s'])} tok/s, {b['GPU (GiB)']:.2f} GiB on the device")
    f = a["fate_lab on the same placement"]
    if f is not None:
        print(f"fate_lab engine, same placement: decode {_fmt(f['decode tok/s'])} tok/s (its runtime's prefetch "
              "presets need a trace: run plan without --fit)")
    print("\n--n-cpu-moe  device GiB  fits  decode tok/s  prefill tok/s")
    for r in a["n_cpu_moe"]:
        print(f"{r['n']:>11}  {r['GPU (GiB)']:>10.2f}  {'yes' if r['fits'] else 'no':>4}  "
              f"{_fmt(r['decode tok/s']):>12}  {_fmt(r['prefill tok/s']):>13}")


def _print_presets(a: dict) -> None:
    import pandas as pd

    print(f"{a['model']} on {a['device']} over {a['link']}, budget {a['budget_bytes'] / 2**30:.2f} GiB, context "
          f"{a['context']} tokens")
    print(f"routing: {a['routing']}")
    for note in a["notes"]:
        print(f"note: {note}")
    with pd.option_context("display.width", 160, "display.max_columns", None):
        if a["memory"]:
            mem = pd.DataFrame(a["memory"]).set_index("config").drop(columns=["slots per layer"])
            print("\nmemory plan (GiB; expert slots over all MoE layers):")
            print(mem.round(3).to_string(), "\n")
        cols = ["TTFT (ms)", "decode tok/s", "decode hit rate", "stall (ms/token)", "MiB moved per token",
                "depends on routing"]
        if a["rows"]:
            print("predicted (simulator on the roofline compute profile):")
            print(pd.DataFrame(a["rows"]).set_index("config")[cols].round(3).fillna("—").to_string())
    for r in a["rows"]:
        if r.get("TTFT note"):
            print(f"TTFT of {r['config']}: — ({r['TTFT note']})")
    for name, why in a["skipped"].items():
        print(f"not simulated: {name}: {why}")
    print(f"\nbest: {a['best']}")


def run_plan(args: argparse.Namespace) -> None:
    """Answer the flags and print (or --json)."""
    a = answer(args)
    if args.json:
        print(json.dumps(a, indent=1, default=str, allow_nan=False))
    elif a["mode"] == "presets":
        _print_presets(a)
    else:
        _print_static(a)
