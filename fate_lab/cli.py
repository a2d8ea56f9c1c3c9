"""Command-line entry points of fate_lab (argparse; one sub-command per job)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _cmd_train(args: argparse.Namespace) -> None:
    from fate_lab.model.train import TrainConfig, train
    from fate_lab.paths import TINY_MOE_DIR

    overrides = {k: v for k, v in {"steps": args.steps, "minutes": args.minutes, "seed": args.seed}.items() if v is not None}
    cfg = TrainConfig.preset(args.preset, **overrides)
    card = train(cfg, Path(args.out) if args.out else TINY_MOE_DIR)
    print(json.dumps({k: card[k] for k in ("parameters", "steps", "wall_minutes", "val_perplexity")}))


def _cmd_trace(args: argparse.Namespace) -> None:
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.models import load_model
    from fate_lab.model.trace import record_trace

    model, tok = load_model(args.model)
    prompts = heldout_prompts(args.prompts, max_chars=args.prompt_chars)
    trace = record_trace(model, tok, prompts, decode_tokens=args.decode_tokens)
    path = trace.save(Path(args.out))
    print(f"trace written to {path}")
    print(json.dumps(trace.summary(), indent=1))


def _cmd_main(args: argparse.Namespace) -> None:
    from fate_lab.mainjob import run_main

    run_main(Path(args.out), model=args.model, fast=args.fast)


def _cmd_check_notebooks(args: argparse.Namespace) -> None:
    from fate_lab.study.notebooks import dirty_notebooks

    dirty = dirty_notebooks(Path(args.folder))
    for line in dirty:
        print(line)
    if dirty:
        raise SystemExit(f"{len(dirty)} notebook(s) keep outputs or widget state; clear them before committing")
    print("notebooks are clean")


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` and run the chosen sub-command."""
    ap = argparse.ArgumentParser(prog="python -m fate_lab", description="fate_lab: offloaded MoE inference lab")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the embedded tiny MoE (writes data/tiny_moe)")
    t.add_argument("--preset", default="tiny")
    t.add_argument("--steps", type=int)
    t.add_argument("--minutes", type=float, help="wall-clock cap; training stops early when spent")
    t.add_argument("--seed", type=int)
    t.add_argument("--out", help="output folder (default: data/tiny_moe)")
    t.set_defaults(func=_cmd_train)
    r = sub.add_parser("trace", help="record a routing trace on held-out prompts")
    r.add_argument("--model", help="local HF MoE checkpoint folder (default: the embedded tiny MoE)")
    r.add_argument("--prompts", type=int, default=8)
    r.add_argument("--prompt-chars", type=int, default=400)
    r.add_argument("--decode-tokens", type=int, default=64)
    r.add_argument("--out", default="results/trace.safetensors")
    r.set_defaults(func=_cmd_trace)
    m = sub.add_parser("main", help="the main job: trace the model, then run every notebook into --out")
    m.add_argument("--model", help="local HF MoE checkpoint folder (default: the embedded tiny MoE)")
    m.add_argument("--out", default="results")
    m.add_argument("--fast", action="store_true", help="small token counts (what the tests run)")
    m.set_defaults(func=_cmd_main)
    c = sub.add_parser("check-notebooks", help="fail if a notebook keeps outputs or widget state")
    c.add_argument("folder", nargs="?", default="notebooks")
    c.set_defaults(func=_cmd_check_notebooks)
    args = ap.parse_args(argv)
    args.func(args)
