"""The stall loop: every numbered notebook run again and again in FAST mode with a tight per-cell limit.

A stall is a cell whose reply the kernel sent but the client never saw: the cell then lasts exactly the
per-cell limit with the kernel idle. Here a run counts as stalled when a cell raises `NotebookCellTimeout` or
lasts at least 95% of the limit; every other cell's duration is kept, so the table shows how far below the
limit the slowest cell stayed.

    python -m benchmarks.stall_loop --rounds 20 --limit 120 --out benchmarks/results/stall_loop_$(date +%F).md
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from tqdm.auto import tqdm

from fate_lab.study.notebooks import NotebookCellTimeout, notebook_errors, notebook_paths, run_notebook


def _durations(out: Path) -> list[float]:
    nb = json.loads(out.read_text())
    return [c["metadata"].get("papermill", {}).get("duration") or 0.0 for c in nb["cells"] if c["cell_type"] == "code"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="runs of every notebook")
    ap.add_argument("--limit", type=int, default=120, help="per-cell limit in seconds (FAST cells take well under it)")
    ap.add_argument("--models", nargs="+", default=["tiny_moe"],
                    help="embedded models each notebook runs with (default: tiny_moe)")
    ap.add_argument("--notebooks", nargs="+", default=None, help="two-digit prefixes (default: all)")
    ap.add_argument("--out", default=None, help="markdown file to write")
    args = ap.parse_args(argv)
    paths = [p for p in notebook_paths() if args.notebooks is None or p.name[:2] in args.notebooks]
    rows: dict[tuple[str, str], dict] = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=args.rounds * len(paths) * len(args.models),
                                                    desc="notebook runs", unit="run") as bar:
        for r in range(args.rounds):
            for model in args.models:
                for path in paths:
                    row = rows.setdefault((path.stem, model), {"runs": 0, "stalls": 0, "errors": 0, "max cell s": 0.0,
                                                               "run s": []})
                    t = time.time()
                    try:
                        out = run_notebook(path, Path(tmp) / f"{r}-{model}", {"MODEL": model, "FAST": True},
                                           timeout=args.limit)
                        took = _durations(out)
                        row["max cell s"] = max(row["max cell s"], max(took, default=0.0))
                        row["stalls"] += any(d >= 0.95 * args.limit for d in took)
                        row["errors"] += bool(notebook_errors(out))
                    except NotebookCellTimeout as e:
                        row["stalls"] += 1
                        print(f"STALL round {r} {path.name} {model}: {e}", file=sys.stderr)
                    except Exception as e:  # an error is not a stall; count it and say what it was
                        row["errors"] += 1
                        print(f"ERROR round {r} {path.name} {model}: {type(e).__name__}: {str(e)[:300]}",
                              file=sys.stderr)
                    row["runs"] += 1
                    row["run s"].append(time.time() - t)
                    bar.update()
    stalls = sum(v["stalls"] for v in rows.values())
    runs = sum(v["runs"] for v in rows.values())
    lines = [f"# Stall loop ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.stall_loop {shlex.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"Every notebook in FAST mode, {args.rounds} rounds, per-cell limit {args.limit} s; a stall = a cell "
             f"timed out or lasted >= 95% of the limit. {runs} notebook runs in {(time.time() - t0) / 60:.0f} min: "
             f"**{stalls} stalls**, {sum(v['errors'] for v in rows.values())} runs with an error.", "",
             "| notebook | model | runs | stalls | errors | slowest cell (s) | run time median / max (s) |",
             "|---|---|---|---|---|---|---|"]
    for (name, model), v in rows.items():
        ts = sorted(v["run s"])
        lines.append(f"| {name} | {model} | {v['runs']} | {v['stalls']} | {v['errors']} | {v['max cell s']:.1f} | "
                     f"{ts[len(ts) // 2]:.0f} / {ts[-1]:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if stalls else 0


if __name__ == "__main__":
    raise SystemExit(main())
