"""Command-line entry points of fate_lab (argparse; one sub-command per job)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _cmd_train(args: argparse.Namespace) -> None:
    from fate_lab.model.train import TrainConfig, train
    from fate_lab.paths import EMBEDDED_MODELS

    overrides = {k: v for k, v in {"steps": args.steps, "minutes": args.minutes, "seed": args.seed}.items() if v is not None}
    cfg = TrainConfig.preset(args.preset, **overrides)
    default_out = EMBEDDED_MODELS.get({"tiny": "tiny_moe"}.get(args.preset, args.preset))
    if args.out is None and default_out is None:
        raise SystemExit(f"--out is required for the {args.preset!r} preset (only the embedded presets write data/)")
    card = train(cfg, Path(args.out) if args.out else default_out)
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

    run_main(Path(args.out), models=args.model, fast=args.fast, tables_only=args.tables_only)


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
    t = sub.add_parser("train", help="train an embedded model (tiny -> data/tiny_moe, tiny_deepseek -> data/tiny_deepseek)")
    t.add_argument("--preset", default="tiny", help="tiny (default model), tiny_deepseek, smoke, smoke_deepseek")
    t.add_argument("--steps", type=int)
    t.add_argument("--minutes", type=float, help="wall-clock cap; training stops early when spent")
    t.add_argument("--seed", type=int)
    t.add_argument("--out", help="output folder (default: the preset's embedded model folder under data/)")
    t.set_defaults(func=_cmd_train)
    r = sub.add_parser("trace", help="record a routing trace on held-out prompts")
    r.add_argument("--model", help="embedded model name or local HF MoE checkpoint folder (default: tiny_moe)")
    r.add_argument("--prompts", type=int, default=8)
    r.add_argument("--prompt-chars", type=int, default=400)
    r.add_argument("--decode-tokens", type=int, default=64)
    r.add_argument("--out", default="results/trace.safetensors")
    r.set_defaults(func=_cmd_trace)
    m = sub.add_parser("main", help="the main job: run every notebook on each model into --out/<model>")
    m.add_argument("--model", action="append", help="embedded model name or local HF MoE checkpoint folder; "
                   "repeat for several (default: every embedded model, tiny_moe and tiny_deepseek)")
    m.add_argument("--out", default="results")
    m.add_argument("--fast", action="store_true", help="small token counts (what the tests run)")
    m.add_argument("--tables-only", action="store_true",
                   help="run nothing: rebuild the side-by-side tables from the notebooks already in --out/<model>")
    m.set_defaults(func=_cmd_main)
    c = sub.add_parser("check-notebooks", help="fail if a notebook keeps outputs or widget state")
    c.add_argument("folder", nargs="?", default="notebooks")
    c.set_defaults(func=_cmd_check_notebooks)
    args = ap.parse_args(argv)
    args.func(args)
