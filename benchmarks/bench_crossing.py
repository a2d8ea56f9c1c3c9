"""What one call from Python into numba-compiled code costs, by how a layer's cache state is passed to it.

Issue 34's plan (docs/DESIGN.md, "What is still written twice") compiles the cache's per-layer state machine, so that
the runtime calls it from Python a few times per experts call (begin, acquire, done, end). numba unboxes every array
argument at each such call; this measures what that costs, so the state's layout can be chosen before the refactor:
one int64 matrix per layer, five separate arrays (how `policy/compiled.CompiledPolicy` passes a policy's state
today), or one jitclass instance. Beside them: an empty call, a begin-like classification of a call's experts, and
today's `CompiledPolicy.access` as the runtime calls it; and, for scale, the same state read without compiled code:
one element of the matrix read from Python (what the cache would pay per look-up if the matrix came before the
compiled steps that read it) and a membership test of the dict the cache keeps today. Each figure is the median
(and range) over `--repeats` timings of the mean of `--calls` calls, on one thread. The runtime's budget for all of
its bookkeeping is 100 us per experts call (`bench_host_path.py`; `lru` measured 71 us).

    python -m benchmarks.bench_crossing --out benchmarks/results/crossing_$(date +%F).md
"""
from __future__ import annotations

import argparse
import statistics
import time
import timeit

import numpy as np
from numba import int64, njit
from numba.experimental import jitclass

E = 64  # experts in a layer


@njit
def _empty() -> int:
    return 0


@njit
def _one_matrix(state, e):
    return state[0, e] + state[1, e]  # rows: where, staged, flags


@njit
def _five_arrays(a, b, c, d, f, e):
    return a[e] + b[e] + c[e] + d[e] + f[e]


@jitclass([("where", int64[:]), ("staged", int64[:]), ("flags", int64[:]), ("last", int64[:]), ("clock", int64)])
class _Layer:
    def __init__(self, n):
        self.where = np.full(n, -1, np.int64)
        self.staged = np.full(n, -1, np.int64)
        self.flags = np.zeros(n, np.int64)
        self.last = np.zeros(n, np.int64)
        self.clock = 0


@njit
def _on_jitclass(layer, e):
    layer.clock += 1
    layer.last[e] = layer.clock
    return layer.where[e]


@njit
def _classify(state, needed, out):
    """A compiled begin's first step: the needed experts that are resident, in order."""
    k = 0
    for i in range(needed.shape[0]):
        e = needed[i]
        if state[0, e] >= 0:
            out[k] = e
            k += 1
    return k


def cases() -> dict:
    """Name -> a zero-argument call, each compiled and run once already."""
    from fate_lab.policy.registry import policy_from_name

    state = np.full((3, E), -1, np.int64)
    state[0, :16] = np.arange(16)
    arrays = [np.zeros(E, np.int64) for _ in range(5)]
    layer = _Layer(E)
    needed, out = np.array([3, 17, 40, 5], np.int64), np.zeros(8, np.int64)
    where = {e: e for e in range(16)}
    policy = policy_from_name("lru", 16, E)
    for e in range(16):
        policy.admit(e)
    calls = {"an empty compiled function": lambda: _empty(),
             "one int64 matrix [3, E] and an int": lambda: _one_matrix(state, 5),
             "five int64 arrays [E] and an int (as CompiledPolicy passes its state)": lambda: _five_arrays(*arrays, 5),
             "one jitclass instance and an int": lambda: _on_jitclass(layer, 5),
             "a begin-like classification: the matrix and two small arrays": lambda: _classify(state, needed, out),
             "CompiledPolicy.access of a resident expert (lru), as the runtime calls it": lambda: policy.access(5),
             "no compiled code: one element of the matrix read from Python": lambda: state[0, 5] >= 0,
             "no compiled code: an id looked up in a dict (the cache's state today)": lambda: 5 in where}
    for f in calls.values():
        f()
    return calls


def main(argv: list[str] | None = None) -> str:
    from fate_lab.study.clock import pinned

    from .report import emit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls per timing (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=7, help="timings per case (default %(default)s)")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        ap.error("--calls and --repeats must be at least 1")
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    lines = [f"# One call from Python into numba-compiled code ({time.strftime('%Y-%m-%d')})", "",
             f"`python -m benchmarks.bench_crossing --calls {args.calls} --repeats {args.repeats}`; numba "
             f"{__import__('numba').__version__}, one thread, machine load {load}. Per call: median [min-max] over "
             f"{args.repeats} timings of {args.calls} calls.", "",
             "| how the state is passed | us per call |", "|---|---|"]
    with pinned(1):
        for name, f in cases().items():
            xs = [1e6 * timeit.timeit(f, number=args.calls) / args.calls for _ in range(args.repeats)]
            lines.append(f"| {name} | {statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}] |")
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
