"""The disk link's readers: an expert read straight into its slot by its byte plan, against transformers' conversion.

Why it matters: the reader threads share the interpreter lock with the compute thread, which takes it for every
torch call. A read that is ~60 small Python steps (the conversion path: tensors rebuilt from the bytes read, hashed,
copied in) holds it often; a read by its byte plan (`fate_lab/offloading/byte_plan.py`: a few numpy copies and one
XXH3 pass, which release it) seldom. Both paths read the same bytes from the disk with O_DIRECT and land the same
bytes in the slot (tests/offloading/test_byte_plan.py); `OffloadConfig(direct_reads=True)` is the plan's path, the
default the conversion path.

Per embedded model, one torch thread (as every benchmark pins it), interleaved rounds, each path in every round:
- a read alone: `DiskEngine.load_now` of every resident expert in turn (full precision, `lru`; packed, `lru_quant`),
  wall time and the reading thread's CPU time per read;
- the compute thread beside one reader that reads without a pause: the decode forward's median time against the
  same forward alone, and the compute time lost per read (the forwards' extra seconds over the reads made meanwhile);
- `generate` over the disk link, cold, 25% of the experts cached: decode tok/s and TTFT of `lru` and `lru_quant`,
  and whether both paths give the same tokens.

    python -m benchmarks.bench_disk_reader --out benchmarks/results/disk_reader_$(date +%F).md
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

import torch

from .report import emit

PATHS = ("conversion", "plan")


def _reads(rt, pairs) -> tuple[float, float]:
    """(wall s, thread CPU s) per read of every pair, in turn."""
    w0, c0 = time.perf_counter(), time.thread_time()
    for p in pairs:
        rt.engine.load_now(*p)
    return (time.perf_counter() - w0) / len(pairs), (time.thread_time() - c0) / len(pairs)


def _beside(model, ids, rt, pairs, reader: bool, seconds: float = 0.6) -> tuple[float, int, float]:
    """(median decode forward s, reads made, seconds) with one reader busy (or none)."""
    stop_c, stop_r, fwd, n = threading.Event(), threading.Event(), [], [0]

    def read() -> None:
        rng = random.Random(0)
        while not stop_r.is_set():
            rt.engine.load_now(*pairs[rng.randrange(len(pairs))])
            n[0] += 1

    from fate_lab.fit.contention import _decode_loop  # the contention trials' own decode loop

    threads = [threading.Thread(target=_decode_loop, args=(model, ids, stop_c, fwd))]
    threads += [threading.Thread(target=read)] if reader else []
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop_c.set()
    threads[0].join()
    stop_r.set()
    for t in threads[1:]:
        t.join()
    return statistics.median(fwd), n[0], time.perf_counter() - t0


def _model_rows(name: str, rounds: int, tokens: int) -> list[str]:
    from fate_lab.core.config import OffloadConfig
    from fate_lab.model.adapters import adapt
    from fate_lab.model.models import load_model
    from fate_lab.offloading.runtime import offload

    model, tok = load_model(name)
    a = adapt(model)
    ckpt = model.name_or_path
    ids = tok("The old lighthouse keeper climbed the stairs every evening to watch the ships", return_tensors="pt"
              ).input_ids
    slots = max(1, round(0.25 * a.num_experts))
    reads: dict[tuple, list[tuple[float, float]]] = {}
    fwd: dict[str, list[tuple[float, int, float]]] = {}
    runs: dict[tuple, list[tuple[float, float]]] = {}
    tokens_of: dict[tuple, torch.Tensor] = {}
    same = True
    for r in range(rounds):
        for preset in ("lru", "lru_quant"):
            for path in PATHS:
                direct = path == "plan"
                with offload(model, OffloadConfig.preset(preset, all_resident=True, link="disk", store="ssd",
                                                         checkpoint=ckpt, direct_reads=direct)) as rt:
                    pairs = [(m, e, s, rt.core.spec(m, "cache")) for m, layer in enumerate(rt.cache.layers)
                             for e, s in layer.where.items()]
                    _reads(rt, pairs[:8])  # warm
                    reads.setdefault((preset, path), []).append(_reads(rt, pairs))
                    if preset == "lru":
                        if not direct:
                            fwd.setdefault("alone", []).append(_beside(model, ids[:, :16], rt, pairs, False))
                        fwd.setdefault(path, []).append(_beside(model, ids[:, :16], rt, pairs, True))
                with offload(model, OffloadConfig.preset(preset, slots=slots, link="disk", store="ssd",
                                                         checkpoint=ckpt, direct_reads=direct)) as rt:
                    out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
                    dec, pre = rt.stats.forward_s["decode"], rt.stats.forward_s["prefill"]
                    runs.setdefault((preset, path), []).append((len(dec) / sum(dec), pre[0]))
                prev = tokens_of.setdefault((preset, r), out)  # the round's first path
                same = same and torch.equal(prev, out)

    def spread(xs, f="{:.0f}", scale=1.0) -> str:
        xs = [x * scale for x in xs]
        return f"{f.format(statistics.median(xs))} [{f.format(min(xs))}-{f.format(max(xs))}]"

    alone = statistics.median(r[0] for r in fwd["alone"])
    lines = [f"## {name}", "", f"{a.num_moe_layers} MoE layers x {a.num_experts} experts; the reads of "
             f"{len(pairs)} resident experts per round; 25% cached = {slots} slots per layer.", "",
             "| path | full read (us): wall / thread CPU | packed read (us): wall / thread CPU | decode forward beside "
             "a busy reader (x alone) | compute lost per read (us) | lru decode tok/s | lru TTFT ms | lru_quant "
             "decode tok/s | lru_quant TTFT ms |", "|---|---|---|---|---|---|---|---|---|"]
    for path in PATHS:
        lost = [(f - alone) * (s / f) / max(1, n) for f, n, s in fwd[path]]  # forwards' extra seconds per read
        cells = [spread([r[0] for r in reads["lru", path]], scale=1e6) + " / " +
                 spread([r[1] for r in reads["lru", path]], scale=1e6),
                 spread([r[0] for r in reads["lru_quant", path]], scale=1e6) + " / " +
                 spread([r[1] for r in reads["lru_quant", path]], scale=1e6),
                 spread([r[0] / alone for r in fwd[path]], "{:.2f}"), spread(lost, scale=1e6)]
        for preset in ("lru", "lru_quant"):
            cells += [spread([r[0] for r in runs[preset, path]], "{:.1f}"),
                      spread([r[1] for r in runs[preset, path]], "{:.1f}", 1e3)]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    med = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
    ratio = {p: med[p, "plan"] / med[p, "conversion"] for p in ("lru", "lru_quant")}
    lines += ["", f"Decode tok/s, plan / conversion: lru {ratio['lru']:.2f}x, lru_quant {ratio['lru_quant']:.2f}x. "
              f"The same tokens on both paths in every round: {'yes' if same else 'NO'}. A decode forward alone: "
              f"{alone * 1e3:.2f} ms.", ""]
    return lines


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=None, help="embedded models (default: both)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=24, help="tokens generated per run (default %(default)s)")
    ap.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = ap.parse_args(argv)
    from fate_lab.paths import EMBEDDED_MODELS
    from fate_lab.study.clock import pinned

    t0, load0 = time.perf_counter(), os.getloadavg()
    lines = [f"# The disk link's readers: byte plan against transformers' conversion ({time.strftime('%Y-%m-%d')})",
             "", f"`python -m benchmarks.bench_disk_reader --rounds {args.rounds} --new-tokens {args.new_tokens}`; "
             f"{os.cpu_count()} cores, load average {load0[0]:.2f} at the start. Medians over {args.rounds} "
             "interleaved rounds [min-max].", ""]
    with pinned():
        for name in args.models or list(EMBEDDED_MODELS):
            lines += _model_rows(name, args.rounds, args.new_tokens)
    lines.append(f"Load average {os.getloadavg()[0]:.2f} at the end. Wall time {time.perf_counter() - t0:.0f} s.")
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
