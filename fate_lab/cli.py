"""Command-line entry points of fate_lab (argparse; one sub-command per job)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _cmd_train(args: argparse.Namespace) -> None:
    from fate_lab.fit.train import TrainConfig, train
    from fate_lab.paths import EMBEDDED_MODELS

    given = {"steps": args.steps, "minutes": args.minutes, "seed": args.seed}
    overrides = {k: v for k, v in given.items() if v is not None}
    cfg = TrainConfig.preset(args.preset, **overrides)
    default_out = EMBEDDED_MODELS.get({"tiny": "tiny_moe"}.get(args.preset, args.preset))
    if args.out is None and default_out is None:
        raise SystemExit(f"--out is required for the {args.preset!r} preset (only the embedded presets write data/)")
    card = train(cfg, Path(args.out) if args.out else default_out)
    print(json.dumps({k: card[k] for k in ("parameters", "steps", "wall_minutes", "val_perplexity")}))


def _cmd_trace(args: argparse.Namespace) -> None:
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.models import load_model
    from fate_lab.model.record import record_trace

    model, tok = load_model(args.model)
    prompts = heldout_prompts(args.prompts, max_chars=args.prompt_chars)
    trace = record_trace(model, tok, prompts, decode_tokens=args.decode_tokens)
    path = trace.save(Path(args.out))
    print(f"trace written to {path}")
    print(json.dumps(trace.summary(), indent=1))


def _cmd_main(args: argparse.Namespace) -> None:
    from fate_lab.mainjob import run_main

    run_main(Path(args.out), models=args.model, fast=args.fast, tables_only=args.tables_only)


def _cmd_train_draft(args: argparse.Namespace) -> None:
    from fate_lab.fit.draft import DraftConfig, train_draft
    from fate_lab.study.speculative import measure_card_acceptance

    overrides = {k: v for k, v in (("minutes", args.minutes), ("steps", args.steps), ("init", args.init),
                                   ("distill", args.distill), ("threads", args.threads)) if v is not None}
    cfg = DraftConfig.preset(args.preset, **overrides)
    from fate_lab.model.draft import TINY_DRAFT_DIR
    from fate_lab.paths import TINY_MOE_DIR

    out, target = Path(args.out or TINY_DRAFT_DIR), Path(args.target or TINY_MOE_DIR)
    card = train_draft(cfg, out, target)
    if not args.no_acceptance:
        card["acceptance"] = measure_card_acceptance(out, target)
    print(json.dumps({k: v for k, v in card.items() if k not in ("history", "seeded_from_target")}, indent=1))


def _cmd_fit_probes(args: argparse.Namespace) -> None:
    import time

    import pandas as pd
    import torch

    from fate_lab.fit.probes import compare_with_percentile, fit_probes, training_trace, tune_thresholds
    from fate_lab.policy.probes import ProbeSet, load_probes, probes_path
    from fate_lab.study import lab  # the model loader and the cached held-out traces of the notebooks

    out = Path(args.out) if args.out else probes_path(lab.model_path(args.model))
    if not args.compare_only:
        torch.manual_seed(args.seed)
        model, tok = lab.load(args.model)
        t0 = time.perf_counter()
        train = training_trace(model, tok, args.prompts, args.decode_tokens, args.prefill_prompts, seed=args.seed)
        probes = fit_probes(train, args.hidden, args.alpha, args.C, args.seed, getattr(torch, args.dtype))
        probes.meta.update(model=lab.model_path(args.model).name, training_prompts=args.prompts,
                           training_decode_tokens_per_prompt=args.decode_tokens,
                           training_prefill_only_prompts=args.prefill_prompts,
                           training_text="fate_lab.fit.probes.train_prompts (training-split documents)",
                           tuning_trace="lab.get_trace(split='calib')")
        probes = tune_thresholds(probes, lab.get_trace(args.model, split="calib"), match=args.match)
        print(f"fitted {probes.kind} probes on {train.num_tokens} training tokens in {time.perf_counter() - t0:.0f} s")
        path = probes.save(out)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) and {path.with_suffix('.json').name}")
    else:
        probes = ProbeSet.load(out) if args.out else load_probes(lab.model_path(args.model))
    table = compare_with_percentile(probes, lab.get_trace(args.model, split="eval"))
    with pd.option_context("display.width", 200, "display.max_columns", None):
        print(table.round(3).to_string(index=False))


def _cmd_fit_similarity(args: argparse.Namespace) -> None:
    import time

    import torch

    from fate_lab.fit.similarity import comparison_table, compute_similarity
    from fate_lab.policy.similarity import similarity_path
    from fate_lab.study import lab  # the cached calib/eval traces of the notebooks

    torch.manual_seed(0)
    model, _ = lab.load(args.model)
    calib = lab.get_trace(args.model, split="calib")
    t0 = time.perf_counter()
    sim = compute_similarity(model, calib, args.max_tokens, args.floor)
    seconds = time.perf_counter() - t0  # printed, not stored: the file stays deterministic
    sim.meta.update(model=lab.model_path(args.model).name, trace="lab.get_trace(split='calib')",
                    groups_below_0_9=[[g for g in sim.clusters(m, 0.9) if len(g) > 1] for m in range(sim.num_layers)])
    print(f"expert similarity: {sim.num_layers} layers x {sim.num_experts} experts on {sim.meta['tokens']} "
          f"calibration tokens in {seconds:.1f} s")
    if not args.no_check:
        rows = comparison_table(model, sim, lab.get_trace(args.model, split="eval"), args.max_tokens)
        sim.meta["comparison_on_eval_trace"] = rows
        print("\nrelative output error of the substitute, measured on the eval trace (1.0 = as bad as dropping):\n")
        keys = list(rows[0])
        print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        for r in rows:
            print("| " + " | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    path = sim.save(args.out or similarity_path(lab.model_path(args.model)))
    print(f"\nwrote {path} and {path.with_suffix('.json').name}")


def _cmd_check_notebooks(args: argparse.Namespace) -> None:
    from fate_lab.study.notebooks import dirty_notebooks

    dirty = dirty_notebooks(Path(args.folder))
    for line in dirty:
        print(line)
    if dirty:
        raise SystemExit(f"{len(dirty)} notebook(s) keep outputs or widget state; clear them before committing")
    print("notebooks are clean")


def _cmd_calibrate_disk(args: argparse.Namespace) -> None:
    from fate_lab.fit.disk import calibrate_disk
    from fate_lab.paths import model_dir

    path = Path(args.path) if args.path else model_dir(None) / "model.safetensors"
    profile, samples = calibrate_disk(path, read_bytes=args.read_kib << 10)
    print(f"O_DIRECT random reads of {path} (page cache bypassed):")
    print(f"{'read':>8} {'queue':>5} {'ms/read':>8} {'GB/s':>6}  rounds' ms/read (min-max)")
    for s in samples:
        spread = f"{min(s.per_read) * 1e3:.3f}-{max(s.per_read) * 1e3:.3f}" if s.per_read else ""
        print(f"{s.size >> 10:>6}Ki {s.queue_depth:>5} {s.seconds / s.reads * 1e3:>8.3f} {s.throughput / 1e9:>6.2f}"
              f"  {spread}")
    print(f"Disk({profile.name!r}, bandwidth={profile.bandwidth / 1e9:.3g}e9, latency={profile.latency:.3g}, "
          f"queue_depth={profile.queue_depth}, readahead={profile.readahead})")
    print(f"as plan's --disk: bw={profile.bandwidth / 1e9:.3g}GBps,lat={profile.latency * 1e6:.0f}us,"
          f"qd={profile.queue_depth},ra={profile.readahead >> 10}KiB")


class _OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (no usage block) and a non-zero exit."""

    def error(self, message: str):
        raise SystemExit(f"{self.prog}: {message} (see {self.prog} --help)")


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` and run the chosen sub-command; a user's error is one line and a non-zero exit."""
    ap = _OneLineParser(prog="python -m fate_lab", description="fate_lab: offloaded MoE inference lab")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train",
                       help="train an embedded model (tiny -> data/tiny_moe, tiny_deepseek -> data/tiny_deepseek)")
    t.add_argument("--preset", default="tiny", help="tiny (default model), tiny_deepseek, smoke, smoke_deepseek")
    t.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    t.add_argument("--minutes", type=float, help="wall-clock cap; training stops early when spent")
    t.add_argument("--seed", type=int, help="seed of the initialisation and the batches (default: the preset's)")
    t.add_argument("--out", help="output folder (default: the preset's embedded model folder under data/)")
    t.set_defaults(func=_cmd_train)
    r = sub.add_parser("trace", help="record a routing trace on held-out prompts")
    r.add_argument("--model", help="embedded model name or local HF MoE checkpoint folder (default: tiny_moe)")
    r.add_argument("--prompts", type=int, default=8, help="held-out prompts to record")
    r.add_argument("--prompt-chars", type=int, default=400, help="characters per prompt (cut at a word boundary)")
    r.add_argument("--decode-tokens", type=int, default=64, help="greedy decode steps per prompt")
    r.add_argument("--out", default="results/trace.safetensors", help="the trace file to write (.safetensors)")
    r.set_defaults(func=_cmd_trace)
    m = sub.add_parser("main", help="the main job: run every notebook on each model into --out/<model>")
    m.add_argument("--model", action="append", help="embedded model name or local HF MoE checkpoint folder; "
                   "repeat for several (default: every embedded model, tiny_moe and tiny_deepseek)")
    m.add_argument("--out", default="results", help="folder of the executed notebooks and the tables")
    m.add_argument("--fast", action="store_true", help="small token counts (what the tests run)")
    m.add_argument("--tables-only", action="store_true",
                   help="run nothing: rebuild the side-by-side tables from the notebooks already in --out/<model>")
    m.set_defaults(func=_cmd_main)
    MODEL_HELP = "embedded model name (tiny_moe, tiny_deepseek) or local HF MoE checkpoint folder (default: tiny_moe)"
    d = sub.add_parser("train-draft", help="train the dense draft model for speculative decoding (data/tiny_draft)")
    d.add_argument("--preset", default="tiny", help="DraftConfig preset (tiny, smoke)")
    d.add_argument("--minutes", type=float, help="wall-clock budget (default: the preset's)")
    d.add_argument("--steps", type=int, help="optimizer steps (default: the preset's)")
    d.add_argument("--init", choices=["moe", "random"], help="seed from the target MoE, or random initialisation")
    d.add_argument("--distill", type=float, help="weight of the KL to the target's logits (0: corpus only)")
    d.add_argument("--threads", type=int, help="torch threads while training")
    d.add_argument("--out", default=None, help="output folder (default: data/tiny_draft)")
    d.add_argument("--target", default=None, help="the target MoE folder (default: data/tiny_moe)")
    d.add_argument("--no-acceptance", action="store_true", help="skip measuring the acceptance rate")
    d.set_defaults(func=_cmd_train_draft)
    fp = sub.add_parser("fit-probes", help="fit the learned cross-layer probes on training-split text, tune them on "
                        "the calib split, save them beside the model, and compare them with the percentile rule")
    fp.add_argument("--model", default=None, help=MODEL_HELP)
    fp.add_argument("--compare-only", action="store_true", help="fit nothing: compare the saved probes")
    fp.add_argument("--prompts", type=int, default=320, help="training-split prompts to prefill and decode")
    fp.add_argument("--decode-tokens", type=int, default=48, help="greedy decode steps per such prompt")
    fp.add_argument("--prefill-prompts", type=int, default=2560, help="further training-split prompts, prefill only")
    fp.add_argument("--hidden", type=int, default=192, help="probe hidden width (0: linear logistic regression)")
    fp.add_argument("--alpha", type=float, default=1e-2, help="L2 strength of MLP probes")
    fp.add_argument("--C", type=float, default=1.0, help="inverse L2 strength of linear probes")
    fp.add_argument("--match", choices=("overall", "layer"), default="overall",
                    help="tune one threshold per phase (overall) or per phase and layer")
    fp.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="storage dtype of the probes")
    fp.add_argument("--seed", type=int, default=0, help="seed of the prompt draw and the fits")
    fp.add_argument("--out", default=None, help="output .safetensors (default: <model>/probes.safetensors)")
    fp.set_defaults(func=_cmd_fit_probes)
    fs = sub.add_parser("fit-similarity", help="compute a model's expert similarity table on its calib trace, save "
                        "it beside the model, and check it on the eval trace")
    fs.add_argument("--model", default=None, help=MODEL_HELP)
    fs.add_argument("--max-tokens", type=int, default=4096, help="calibration tokens (evenly spaced rows)")
    fs.add_argument("--floor", type=float, default=0.02, help="weight of tokens not routed to the expert")
    fs.add_argument("--out", default=None, help="output .safetensors (default: <model>/expert_similarity.safetensors)")
    fs.add_argument("--no-check", action="store_true", help="skip the comparison on the eval trace")
    fs.set_defaults(func=_cmd_fit_similarity)
    from fate_lab.study.plan_cli import add_plan_parser

    add_plan_parser(sub)
    cd = sub.add_parser("calibrate-disk", help="measure this machine's disk with O_DIRECT reads and print it as a "
                        "link profile (latency, bandwidth, queue depth)")
    cd.add_argument("path", nargs="?", default=None, help="a file on the disk to read (default: the default "
                    "embedded model's model.safetensors)")
    cd.add_argument("--read-kib", type=int, default=384, help="the read size (KiB) whose best queue depth is kept")
    cd.set_defaults(func=_cmd_calibrate_disk)
    c = sub.add_parser("check-notebooks", help="fail if a notebook keeps outputs or widget state")
    c.add_argument("folder", nargs="?", default="notebooks", help="folder of the notebooks to check")
    c.set_defaults(func=_cmd_check_notebooks)
    args = ap.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError) as exc:  # a user's bad input: one line, no traceback, a non-zero exit
        raise SystemExit(f"python -m fate_lab {args.cmd}: " + " ".join(str(exc).split())) from None
