"""Host time per MoE layer: the plain transformers experts call beside fate_lab's offloaded one, on the CPU.

What bounds a cache-hit-heavy decode on a GPU is not the link but the host: the Python work around each experts
call. This measures it where the expert math is negligible: a tiny random Qwen2-MoE (hidden 64, 8 MoE layers,
8 experts of width 32, top-2), every expert cached (slots for all), the instant link, one torch thread, warm.

The same forward hooks time every call: a pre/post hook pair on each layer's experts module (the experts call),
on each decoder layer (the layer), and on the whole model (the forward). Per round, interleaved: plain
`generate`, then `offload(model, preset)` for each preset, `--tokens` decode tokens each; the median per call
of each round, then the median and spread (min-max) over `--rounds` rounds.

- experts call: the median time inside one experts module's forward (offloaded: the runtime's call, the
  cache's bookkeeping and the prediction included);
- other hooks per layer: (decoder layer - experts call) offloaded minus the same for plain, i.e. what the
  runtime's router and layer hooks add outside the experts call.

    python -m benchmarks.bench_host_path --out benchmarks/results/host_path_$(date +%F).md
    python -m benchmarks.bench_host_path --device cuda   # the same on a GPU: the host time a GPU run pays
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from .report import emit

PRESETS = ("lru", "fate")


class Clock:
    """Pre/post forward hooks that record each call's wall time, per kind of module."""

    def __init__(self, model):
        self.spans: dict[str, list[float]] = {"experts": [], "layer": [], "forward": []}
        self.handles = []
        for kind, mods in (("experts", [m for n, m in model.named_modules() if n.endswith("mlp.experts")]),
                           ("layer", list(model.model.layers)), ("forward", [model])):
            for m in mods:
                self._hook(m, kind)

    def _hook(self, mod, kind: str) -> None:
        start: list[float] = []

        def pre(*_) -> None:
            start.append(time.perf_counter())

        def post(*_) -> None:  # returns None: a forward hook that returns a value replaces the output
            self.spans[kind].append(time.perf_counter() - start.pop())

        self.handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def reset(self) -> None:
        for v in self.spans.values():
            v.clear()

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.spans.items() if v}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _cpu_name() -> str:
    """The host CPU's model name (Linux), or the platform's word for it."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "an unnamed CPU"


def decode(model, ids, n: int):
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per run (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--out", default=None, help="also write the report to this markdown file")
    ap.add_argument("--device", default="cpu", help="where the model runs: cpu (default) or cuda")
    args = ap.parse_args(argv)
    from fate_lab.core.config import OffloadConfig
    from fate_lab.model.testing import tiny_model
    from fate_lab.offloading.runtime import offload

    torch.set_num_threads(1)
    model = tiny_model("qwen2_moe", seed=0, num_hidden_layers=8).to(args.device)
    cfg = model.config
    slots = cfg.num_hidden_layers * cfg.num_experts
    ids = torch.randint(1, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(args.device)
    clock = Clock(model)
    load0 = os.getloadavg()[0]
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in ("plain", *PRESETS)}
    plain_tokens = decode(model, ids, args.tokens)
    same = {}
    for _ in range(args.rounds):
        decode(model, ids, 4)
        clock.reset()
        decode(model, ids, args.tokens)
        runs["plain"].append(clock.medians())
        for name in PRESETS:
            with offload(model, OffloadConfig.preset(name, slots=slots, link="instant")):
                decode(model, ids, 4)  # warm: every expert loaded, the predictor's first call made
                clock.reset()
                out = decode(model, ids, args.tokens)
                runs[name].append(clock.medians())
                same[name] = same.get(name, True) and torch.equal(out, plain_tokens)
    clock.remove()
    load1 = os.getloadavg()[0]

    def stat(name: str, f) -> str:
        xs = [f(r, p) * 1e6 for r, p in zip(runs[name], runs["plain"], strict=True)]
        return f"{statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})"

    where = f"on {_cpu_name()}" + (f", the model on {torch.cuda.get_device_name()}" if args.device == "cuda" else "")
    lines = [f"# Host time per MoE layer ({time.strftime('%Y-%m-%d')}, {args.device})", "",
             f"`python -m benchmarks.bench_host_path --tokens {args.tokens} --rounds {args.rounds} "
             f"--device {args.device}`; {where}.", "",
             f"Tiny random Qwen2-MoE (hidden {cfg.hidden_size}, {cfg.num_hidden_layers} MoE layers, "
             f"{cfg.num_experts} experts of width {cfg.moe_intermediate_size}, top-{cfg.num_experts_per_tok}), "
             f"every expert cached ({slots} slots), link 'instant', one torch thread, {args.tokens} decode tokens x "
             f"{args.rounds} interleaved rounds; {os.cpu_count()} cores, load average {load0:.1f} at the start and "
             f"{load1:.1f} at the end. Microseconds: median over rounds of each round's median per call "
             "(min-max over rounds).", "",
             "| run | experts call (us) | decoder layer (us) | forward (us) | other hooks per layer vs plain (us) "
             "| tokens == plain |", "|---|---|---|---|---|---|"]
    for name in ("plain", *PRESETS):
        other = "—" if name == "plain" else stat(
            name, lambda r, p: (r["layer"] - r["experts"]) - (p["layer"] - p["experts"]))
        lines.append(f"| {name} | {stat(name, lambda r, p: r['experts'])} | {stat(name, lambda r, p: r['layer'])} | "
                     f"{stat(name, lambda r, p: r['forward'])} | {other} | "
                     f"{'—' if name == 'plain' else 'yes' if same[name] else 'NO'} |")
    return emit(lines, args.out)


if __name__ == "__main__":
    main()
