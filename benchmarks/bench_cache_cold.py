"""The expert cache's own bookkeeping on cold calls: host time per experts call with nothing resident yet.

A cold prefill of an offloaded model misses most of its experts, and every miss runs the cache's bookkeeping on the
compute thread: a slot reserved, the replacement policy's admit with its protect set (the experts the call still
needs), a transfer queued, and, once the cache is full, a retry per computed expert for the misses still waiting for
a slot. Beside busy disk readers such Python work runs 3-5x slower (`docs/disk.md`), so it shows up in the TTFT of
`link="disk"`. This times `ExpertCache` alone, as `policy/step.run_layer` drives it (begin, then acquire and done per
expert in the cache's order, end), behind a mover whose transfers land at once, so the figure is bookkeeping only:
`--layers` layers of `--experts` experts, each call needing `--needed` distinct ones (a seeded random draw), a fresh
cache per prefill, one thread. Per case: median [min-max] over `--repeats` timings of the median of `--prefills`
prefills, in microseconds per experts call.

    python -m benchmarks.bench_cache_cold --out benchmarks/results/cache_cold_$(date +%F).md
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import time


class _Landed:
    """A mover whose transfers have landed when `submit` returns (nothing to wait for, nothing fails)."""

    def submit(self, m, e, slot, urgent, reason):
        return True

    def cancel(self, handle) -> bool:
        return False

    def poll(self, handle) -> bool:
        return True

    def wait(self, m, e, handle) -> bool:
        return True

    def reload(self, m, e, slot, reason):  # pragma: no cover - nothing fails here
        raise RuntimeError("an instant transfer cannot fail")

    def capacity(self, m):
        return None

    def view(self, m):
        return None


def prefill_us(policy: str, cap: int, calls: list[list[int]], experts: int, top_k: int) -> float:
    """One cold prefill through a fresh cache: microseconds per experts call."""
    from fate_lab.policy.cache import ExpertCache
    from fate_lab.policy.registry import policy_from_name

    cache = ExpertCache([cap] * len(calls), lambda m, n: policy_from_name(policy, n, experts), top_k=top_k,
                        prefetch_buffers=top_k, mover=_Landed())
    t = time.perf_counter()
    for m, need in enumerate(calls):
        for e in cache.begin(m, need):
            cache.acquire(m, e)
            cache.done(m, e)
        cache.end(m)
    return (time.perf_counter() - t) / len(calls) * 1e6


def main(argv: list[str] | None = None) -> str:
    from fate_lab.study.clock import pinned

    from .report import emit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64, help="experts per layer (default %(default)s, tiny_deepseek)")
    ap.add_argument("--needed", type=int, default=40, help="distinct experts per call (default %(default)s)")
    ap.add_argument("--layers", type=int, default=8, help="MoE layers (default %(default)s)")
    ap.add_argument("--top-k", type=int, default=6, help="demand slots and prefetch slots per pool (default 6)")
    ap.add_argument("--caps", type=int, nargs="+", default=[6, 16, 32], help="cache slots per layer to time")
    ap.add_argument("--policies", nargs="+", default=["lru", "arc"], help="registered policies to time")
    ap.add_argument("--prefills", type=int, default=200, help="prefills per timing (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="timings per case (default %(default)s)")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    if min(args.experts, args.needed, args.layers, args.top_k, args.prefills, args.repeats) < 1:
        ap.error("--experts, --needed, --layers, --top-k, --prefills and --repeats must be at least 1")
    if args.needed > args.experts or min(args.caps) < 0:
        ap.error("--needed must be at most --experts, and --caps at least 0")
    rng = random.Random(0)
    calls = [rng.sample(range(args.experts), args.needed) for _ in range(args.layers)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    lines = [f"# The expert cache's bookkeeping on cold calls ({time.strftime('%Y-%m-%d')}, commit {commit or '?'})",
             "", f"`python -m benchmarks.bench_cache_cold --experts {args.experts} --needed {args.needed} --layers "
             f"{args.layers} --top-k {args.top_k}`; one thread, machine load {load}. Host time per experts call of a "
             f"cold prefill (a fresh cache each), median [min-max] over {args.repeats} timings of the median of "
             f"{args.prefills} prefills.", "",
             "| policy | cache slots per layer | us per experts call |", "|---|---|---|"]
    with pinned(1):
        for policy in args.policies:
            for cap in args.caps:
                for _ in range(20):  # compile and warm
                    prefill_us(policy, cap, calls, args.experts, args.top_k)
                xs = [statistics.median(prefill_us(policy, cap, calls, args.experts, args.top_k)
                                        for _ in range(args.prefills)) for _ in range(args.repeats)]
                lines.append(f"| {policy} | {cap} | {statistics.median(xs):.0f} [{min(xs):.0f}-{max(xs):.0f}] |")
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
