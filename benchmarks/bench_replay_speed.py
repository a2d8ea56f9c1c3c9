"""Replay speed: expert look-ups per second of the compiled replay, the pure cache and a 20-line OrderedDict LRU.

In one run, on three workloads -- both embedded models' held-out traces (prefill + decode) and a real-size
array (180k tokens x 26 layers x top-6 of 64, built from tiny_deepseek's routing: benchmarks/real_size.py) --
each policy replays every layer at 25% of the experts cached:
  fast        `replay_jobs_fast` over all layers (the compiled replay; `replay(..., fast=True)` calls it),
  fast+pred   the same with a predicted set per token and layer (admitted on use, k staging slots): Fate's
              cross-layer gate, top-(k+2), on the embedded models; the previous token's experts on the array,
  pure        `replay_layer_pure`: the `ExpertCache` (the reference semantics; on the array, the first 10k
              tokens of every layer),
  OrderedDict a 20-line request-at-a-time LRU (no protection of the current token), the floor any replay
              should beat,
  libCacheSim its C simulator on the same per-layer streams, one request at a time (optional, GPL: never
              imported by fate_lab; skipped when absent).
First, the public calls as users make them (`replay` and `sweep` on the array, end to end) beside the kernel
alone and the OrderedDict LRU (`--public-only`: that table alone). Then the miss curves (`miss_curves`, public:
every capacity 0..E of every layer) of every policy on the array, in 2 threads,
and the first-call cost of the kernels (compile into an empty cache, in a fresh process).

    python -m benchmarks.bench_replay_speed --out benchmarks/results/replay_speed_2026-12-01.md [--quick]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict

import numpy as np

from fate_lab.policy.registry import POLICIES as REGISTRY

# every registered policy the replay can run on a bare array (router_ema reads a Trace's router probabilities)
POLICIES = [n for n, p in REGISTRY.items() if not p.needs_scores]


def ordered_dict_lru(rows: list[list[int]], capacity: int) -> int:
    """Hits of a plain LRU over the requests row by row (the 20-line reference)."""
    od: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for row in rows:
        for e in row:
            if e in od:
                od.move_to_end(e)
                hits += 1
            else:
                od[e] = None
                if len(od) > capacity:
                    od.popitem(last=False)
    return hits


def real_size_array(quick: bool):
    """(experts [N, L, 6], phase [N], E): the real-size array (20k tokens when quick)."""
    from benchmarks.real_size import real_size_routing

    return real_size_routing(tokens=20_000 if quick else 180_000)


def previous_token_sets(ex: np.ndarray):
    """PredictedSets: for token t and layer l, the experts layer l used at token t - 1 (none at t = 0)."""
    from fate_lab.sim.fast_replay import PredictedSets

    N, L, k = ex.shape
    offsets = np.zeros((L, N + 1), np.int64)
    offsets[:, 2:] = k * np.arange(1, N)[None, :]
    offsets += (np.arange(L) * k * (N - 1))[:, None]
    offsets[:, 0] = offsets[:, 1]
    return PredictedSets(offsets, np.ascontiguousarray(ex[:-1].transpose(1, 0, 2)).reshape(-1).astype(np.int32))


def workloads(quick: bool):
    """(name, experts [N, L, k] int32, phase [N], E, predicted sets, pure-path token count)."""
    from fate_lab.policy.rules import TopKPlus, cross_layer_scores
    from fate_lab.sim.fast_replay import predicted_sets
    from fate_lab.sim.replay import predictions_from_rule
    from fate_lab.study.lab import get_trace

    out = []
    for model in ("tiny_moe", "tiny_deepseek"):
        tr = get_trace(model, fast=quick)
        ex = tr.experts.numpy().astype(np.int32)
        k = ex.shape[2]
        scores = cross_layer_scores(tr.gate_inputs, tr.router_weights, tr.meta.get("scoring", "softmax"))
        preds = predicted_sets(predictions_from_rule(scores, TopKPlus(k, 2)), ex.shape[1])
        out.append((model, ex, tr.phase.numpy(), int(tr.meta["num_experts"]), preds, ex.shape[0]))
    ex, phase, E = real_size_array(quick)
    out.append(("real-size array", ex, phase, E, previous_token_sets(ex), min(ex.shape[0], 2_000 if quick else 10_000)))
    return out


def timed(fn):
    """(result, wall seconds, CPU seconds of this process)."""
    w, c = time.perf_counter(), time.process_time()
    r = fn()
    return r, time.perf_counter() - w, time.process_time() - c


def rate(fn, lookups: int, warm: bool = True, min_seconds: float = 0.5) -> tuple[float, float]:
    """(wall, CPU) million look-ups per second of fn, repeated for at least min_seconds (after one warm-up call)."""
    if warm:
        fn()
    n, wall, cpu = 0, 0.0, 0.0
    while n == 0 or (warm and wall < min_seconds):
        _, w, c = timed(fn)
        n, wall, cpu = n + 1, wall + w, cpu + c
    return lookups * n / wall / 1e6, lookups * n / max(cpu, 1e-9) / 1e6


class LibCacheSimStreams:
    """The per-layer request streams of a workload as libCacheSim traces (written once), and their replay speed."""

    def __init__(self, ex: np.ndarray):
        from benchmarks.bench_policies import oracle_file

        self.dir = tempfile.TemporaryDirectory()
        self.lookups = ex.shape[0] * ex.shape[2]
        self.paths = [oracle_file(ex[:, l].reshape(-1), os.path.join(self.dir.name, f"l{l}.bin"))
                      for l in range(ex.shape[1])]

    def speed(self, cap: int, policy: str) -> tuple[float, float] | None:
        """(wall, CPU) M look-ups/s of libCacheSim over every layer's stream, or None where it has no such policy."""
        import libcachesim as lcs

        from benchmarks.bench_policies import LCS_CLASSES

        cls = LCS_CLASSES.get(policy)
        if cls is None or (policy == "s3fifo" and cap < 20):
            return None
        wall = cpu = 0.0
        for path in self.paths:
            reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
            cache = getattr(lcs, cls)(cache_size=cap)
            _, w, c = timed(lambda cache=cache, reader=reader: cache.process_trace(reader))
            wall, cpu = wall + w, cpu + c
        n = self.lookups * len(self.paths)
        return n / wall / 1e6, n / max(cpu, 1e-9) / 1e6


def first_call_seconds() -> float:
    """Seconds of a first fast replay in a fresh process whose numba cache is empty (compile included)."""
    code = ("import time, numpy as np; t = time.perf_counter(); from fate_lab.sim.fast_replay import replay_layer_fast;"
            "replay_layer_fast(np.zeros((4, 2), np.int64), policy='lru', capacity=1); print(time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(res.stdout.split()[-1])


def machine() -> str:
    """CPU model, cores, Python and numba versions."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import numba

    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, numba {numba.__version__}"


def _pair(r: tuple[float, float] | None, digits: int = 1) -> str:
    return "—" if r is None else f"{r[0]:.{digits}f} ({r[1]:.{digits}f})"


def speed_table(name, ex, phase, E, preds, n_pure) -> list[str]:
    """One workload's rows."""
    from fate_lab.sim.fast_replay import replay_jobs_fast
    from fate_lab.sim.replay import replay_layer_pure

    N, L, k = ex.shape
    cap = E // 4
    lookups, pure_lookups = N * L * k, n_pure * L * k
    rows = [[ex[t, l].tolist() for t in range(n_pure)] for l in range(L)]
    od = rate(lambda: [ordered_dict_lru(r, cap) for r in rows], pure_lookups, warm=False)
    pure_preds = [preds.layer_lists(l)[:n_pure] for l in range(L)]
    ph = [int(p) for p in phase[:n_pure]]
    jobs = dict(layers=list(range(L)), capacities=[cap] * L)
    streams = LibCacheSimStreams(ex) if importlib.util.find_spec("libcachesim") else None  # GPL: benchmark only
    out = [f"## {name}: {N} tokens x {L} layers x top-{k} of {E}, {cap} slots per layer", "",
           "| policy | fast | fast+pred | pure | pure+pred | fast / pure (CPU) | libCacheSim "
           "| hit rate (fast = pure) |",
           "|---|---|---|---|---|---|---|---|"]
    for pol in POLICIES:
        res = replay_jobs_fast(ex, phase, policy=pol, **jobs)
        fast = rate(lambda pol=pol: replay_jobs_fast(ex, phase, policy=pol, **jobs), lookups)
        fastp = rate(lambda pol=pol: replay_jobs_fast(ex, phase, policy=pol, predictions=preds, buffer=k,
                                                      admit="on_use", **jobs), lookups)
        pure = rate(lambda pol=pol: [replay_layer_pure(rows[l], ph, pol, cap) for l in range(L)], pure_lookups,
                    warm=False)
        purep = rate(lambda pol=pol: [replay_layer_pure(rows[l], ph, pol, cap, predictions=pure_preds[l], buffer=k,
                                                        admit="on_use") for l in range(L)], pure_lookups, warm=False)
        lc = None if streams is None else streams.speed(cap, pol)
        hit = sum(r["hits"] for r in res) / sum(r["uses"] for r in res)
        out.append(f"| {pol} | {_pair(fast)} | {_pair(fastp)} | {_pair(pure, 2)} | {_pair(purep, 2)} | "
                   f"{fast[1] / pure[1]:.0f}x | {_pair(lc)} | {hit:.3f} |")
    pure_note = "" if n_pure == N else f" (pure, pure+pred and OrderedDict: the first {n_pure} tokens of every layer)"
    out += ["", f"OrderedDict LRU: {_pair(od, 2)} M look-ups/s{pure_note}.", ""]
    return out


def public_table(quick: bool, policies: list[str] = POLICIES) -> list[str]:
    """The public calls as the docs show them, on the real-size array, beside the kernel alone and OrderedDict.

    `replay(ex, slots_per_layer=..., policy=...)` and `sweep(...)` take the numpy array as a user has it: their
    input checks, conversion, config and stats are all inside the time. The kernel column times
    `replay_jobs_fast` alone on the same array (what the tables above call fast).
    """
    from fate_lab.sim.fast_replay import replay_jobs_fast
    from fate_lab.sim.replay import replay, sweep

    ex, phase, E = real_size_array(quick)
    N, L, k = ex.shape
    cap, lookups = E // 4, N * L * k
    rows = [[ex[t, l].tolist() for t in range(N)] for l in range(L)]
    od = rate(lambda: [ordered_dict_lru(r, cap) for r in rows], lookups, warm=False)
    jobs = dict(layers=list(range(L)), capacities=[cap] * L)
    out = [f"## The public calls: {N} tokens x {L} layers x top-{k} of {E} (numpy array), {cap} slots per layer", "",
           f"`replay(ex, slots_per_layer={cap}, policy=...)` end to end (checks, conversion, config, stats) beside "
           "the compiled kernel alone on the same array, and the 20-line OrderedDict LRU over the same "
           f"{lookups / 1e6:.0f}M look-ups in this process: {_pair(od, 2)} M look-ups/s.", "",
           f"The last two columns: `replay(..., n_jobs=-1)`, the layers on every core ({os.cpu_count()} here).", "",
           "| policy | replay() public | kernel alone | public / kernel (wall) | public / OrderedDict LRU (wall) "
           "| replay(n_jobs=-1) | its / OrderedDict LRU |",
           "|---|---|---|---|---|---|---|"]
    for pol in policies:
        pub = rate(lambda pol=pol: replay(ex, slots_per_layer=cap, policy=pol), lookups)
        ker = rate(lambda pol=pol: replay_jobs_fast(ex, None, policy=pol, **jobs), lookups)
        par = rate(lambda pol=pol: replay(ex, slots_per_layer=cap, policy=pol, n_jobs=-1), lookups)
        out.append(f"| {pol} | {_pair(pub)} | {_pair(ker)} | {pub[0] / ker[0]:.2f} | {pub[0] / od[0]:.1f}x "
                   f"| {_pair(par)} | {par[0] / od[0]:.1f}x |")
    bounds, budgets = [0, L // 4, L // 2], [L * E // 8, L * E // 4, L * E // 2]
    res, wall, cpu = timed(lambda: sweep(ex, boundaries=bounds, budgets=budgets, num_experts=E, policy="arc"))
    pairs = len({(l, s) for sl in res["slots"] for l, s in enumerate(sl)})
    out += ["", f"`sweep(ex, boundaries={bounds}, budgets={budgets}, num_experts={E}, policy='arc')`: {pairs} layer "
            f"replays in {wall:.1f} s wall ({cpu:.1f} s CPU), {pairs * N * k / wall / 1e6:.1f} M look-ups/s wall.", ""]
    return out


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the report to this markdown file")
    ap.add_argument("--quick", action="store_true", help="FAST traces and a 20k-token array (a smoke run)")
    ap.add_argument("--no-curves", action="store_true", help="skip the miss curves")
    ap.add_argument("--public-only", action="store_true",
                    help="only the public calls' table (replay, sweep) on the real-size array: a few minutes")
    ap.add_argument("--policies", nargs="+", default=POLICIES, choices=POLICIES, metavar="NAME",
                    help="the policies of the public calls' table (default: every one a bare array can run)")
    args = ap.parse_args(argv)
    from fate_lab.sim.fast_replay import replay_jobs_fast
    from fate_lab.sim.replay import miss_curves

    t0 = time.time()
    load0 = os.getloadavg()
    first = first_call_seconds()
    replay_jobs_fast(np.zeros((4, 1, 2), np.int32), policy="lru", layers=[0], capacities=[1])  # load the cache
    lines = [f"# Replay speed ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.bench_replay_speed {shlex.join(argv if argv is not None else sys.argv[1:])}`", "",
             f"Machine: {machine()}; load average {load0[0]:.1f} at the start (other jobs were running on the 2 "
             "cores: a quiet machine gives higher numbers).", "",
             "Million expert look-ups per second (a look-up: one expert of one token in one layer), every layer at "
             "25% of the experts cached, as wall clock (CPU time of this process in brackets: the machine was "
             "shared, so wall-clock rates understate the code). fast / fast+pred: the compiled replay without / "
             "with a predicted set "
             "(admitted on use, k staging slots); pure: `replay_layer_pure`, the `ExpertCache` (identical counts, "
             "tests/sim/test_fast_replay.py); libCacheSim: its C simulator on the same per-layer streams, request at a "
             "time, no protection of the current token (S3-FIFO only from 20 slots, where libCacheSim's small queue "
             "holds 2 objects). The real-size array is built from tiny_deepseek's routing (benchmarks/real_size.py).",
             ""]
    lines += public_table(args.quick, args.policies)
    for w in ([] if args.public_only else workloads(args.quick)):
        lines += speed_table(*w)
    if not args.no_curves and not args.public_only:
        ex, _, E = real_size_array(args.quick)
        N, L, k = ex.shape
        lines += [f"## Miss curves: every capacity 0..{E} of all {L} layers of the array ({N} tokens x top-{k}, "
                  f"{N * L * k * (E + 1) / 1e9:.2f}G look-ups), 2 threads", "",
                  "| policy | wall seconds | CPU seconds (both threads) | M look-ups/s, wall |", "|---|---|---|---|"]
        for pol in POLICIES:
            _, wall, cpu = timed(lambda pol=pol: miss_curves(ex, E, policy=pol, n_jobs=2))
            lines.append(f"| {pol} | {wall:.1f} | {cpu:.1f} | {N * L * k * (E + 1) / wall / 1e6:.0f} |")
        lines.append("")
    load1 = os.getloadavg()
    lines += [f"First LRU replay in a fresh process with an empty numba cache (compiles LRU's loop, its functions and "
              f"the input checks; each further policy compiles its own loop on its first replay): {first:.0f} s; "
              "later processes load the cached kernels in about a second.", "",
              f"Load average {load1[0]:.1f} at the end. Wall time {time.time() - t0:.0f} s."]
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
