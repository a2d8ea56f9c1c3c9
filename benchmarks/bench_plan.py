"""How long the sizing tool takes as users call it: one `plan` of a placement, and a `--fit` over every
`--n-cpu-moe` (and every `-ngl`) of a 61-layer model (DeepSeek-V3), target under 10 s on this machine.

Each round runs, interleaved: the command line in a fresh process (`python -m fate_lab plan ...`: the interpreter,
transformers' import and the meta-device build of the config included, what a user waits for), and the same two
calls in this process after a first one (`cli.main`, the config's build remembered), and the inner search
(`study.fit.fit`) beside them; and a first run whose config is not yet remembered (`plan_model.cache_dir`:
transformers' modeling code imported, the model built on the meta device). Medians and the spread (min-max) over
the rounds; the machine's load average is written beside them, since other work shares the CPU.

    python -m benchmarks.bench_plan --rounds 5 --out benchmarks/results/plan_$(date +%F).md
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 10.0
MODEL = "DeepSeek-V3"  # 61 decoder layers, 256 experts
ONE = ["--model", MODEL, "--device", "rtx4090", "--weights", "q4_k_m", "--n-cpu-moe", "58", "--host",
       "xeon_gold_6454s", "--engine", "ktransformers"]
FIT = ["--model", MODEL, "--device", "rtx4090", "--weights", "q4_k_m", "--host", "xeon_gold_6454s", "--fit"]


def _fresh(argv: list[str], cache: str | None = None) -> float:
    """A fresh process; `cache`: an empty FATE_LAB_CACHE (the config is built, as on a user's first run)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"FATE_LAB_CACHE": cache} if cache else {})}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fate_lab", "plan", *argv], cwd=ROOT, check=True, capture_output=True,
                   env=env)
    return time.perf_counter() - t0


def _warm(argv: list[str]) -> float:
    from fate_lab.cli import main

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        main(["plan", *argv])
    return time.perf_counter() - t0


def _inner() -> float:
    from fate_lab.study.fit import fit, setting

    s = setting(MODEL, "rtx4090", "xeon_gold_6454s", weights="q4_k_m")
    t0 = time.perf_counter()
    fit(s)
    return time.perf_counter() - t0


def _stat(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every timing")
    ap.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    _warm(ONE)  # the first call builds the config on the meta device; later calls reuse it
    import tempfile

    times: dict[str, list[float]] = {k: [] for k in ("--fit, fresh process, first run (config built)",
                                                     "one plan, fresh process", "--fit, fresh process",
                                                     "one plan, in process", "--fit, in process", "fit() search")}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as empty:
            times["--fit, fresh process, first run (config built)"].append(_fresh(FIT, empty))
        times["one plan, fresh process"].append(_fresh(ONE))
        times["--fit, fresh process"].append(_fresh(FIT))
        times["one plan, in process"].append(_warm(ONE))
        times["--fit, in process"].append(_warm(FIT))
        times["fit() search"].append(_inner())
    load1 = os.getloadavg()
    worst = max(times["--fit, fresh process"])
    cold = max(times["--fit, fresh process, first run (config built)"])
    lines = [f"# plan timings ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, load average "
             f"{load0[0]:.2f} before / {load1[0]:.2f} after)", "",
             f"`python -m benchmarks.bench_plan --rounds {args.rounds}`; {MODEL} (61 layers, 256 experts), median "
             "(min-max) of interleaved rounds.", "", "| call | time |", "|---|---|",
             *[f"| {k} | {_stat(v)} |" for k, v in times.items()], "",
             f"one plan: `python -m fate_lab plan {' '.join(ONE)}`", "",
             f"--fit (62 --n-cpu-moe + 63 -ngl candidates, and the largest context): `python -m fate_lab plan "
             f"{' '.join(FIT)}`", "",
             f"Target: a --fit under {TARGET_S:g} s as a user runs it: slowest round {worst:.2f} s, "
             f"{'met' if worst < TARGET_S else 'NOT met'}; a first run, building the config: slowest {cold:.2f} s, "
             f"{'met' if cold < TARGET_S else 'NOT met'}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
