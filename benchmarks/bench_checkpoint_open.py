"""Opening and reading a checkpoint of a real MoE's key count: `offload(store="ssd")`, `link="disk"`, per-expert reads.

A safetensors file starts with a JSON header listing every tensor; a real MoE checkpoint has tens of thousands of
keys (Qwen3-30B-A3B: 48 MoE layers x 128 experts x 3 projections = 18,432 expert tensors over 16 shards), so parsing
a header costs milliseconds, and the key count, not the bytes, decides what an open costs. This builds a random
Qwen2-MoE of that key count with tiny tensors (hidden 16, expert width 16, 48 layers x 128 experts, saved in
`--shards` shards), then times, as a user calls them:
- `offload(model, OffloadConfig.preset("lru", store="ssd", checkpoint=DIR, link="instant", slots=...))`: the SSD
  tier's open, which reads and digests every expert once;
- the same with `link="disk"` (the disk store also locates every expert's byte ranges in the headers);
- one expert read, `SafetensorsStore.fetch(m, e)` (each file kept open, stat-checked per read), beside the same read
  through `ExpertIndex.read` with one `safe_open` per tensor (what every read did before).

    python -m benchmarks.bench_checkpoint_open --out benchmarks/results/checkpoint_open_$(date +%F).md
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from .report import emit


def _model(layers: int, experts: int):
    from fate_lab.model.testing import tiny_model

    return tiny_model("qwen2_moe", seed=0, num_hidden_layers=layers, num_experts=experts, hidden_size=16,
                      moe_intermediate_size=16, intermediate_size=16, shared_expert_intermediate_size=16,
                      num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=4)


def _open_s(model, folder: Path, link: str, repeats: int) -> list[float]:
    from fate_lab import OffloadConfig
    from fate_lab.offloading.runtime import offload

    out = []
    for _ in range(repeats):
        cfg = OffloadConfig.preset("lru", store="ssd", checkpoint=str(folder), link=link, slots=64)
        t = time.perf_counter()
        rt = offload(model, cfg)
        out.append(time.perf_counter() - t)
        rt.close()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48, help="MoE layers of the random model (default %(default)s)")
    ap.add_argument("--experts", type=int, default=128, help="experts per layer (default %(default)s)")
    ap.add_argument("--shards", type=int, default=16, help="safetensors shards to save (about; default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each call (default %(default)s)")
    ap.add_argument("--reads", type=int, default=256, help="expert reads timed each way")
    ap.add_argument("--out", help="also write the table to this markdown file")
    args = ap.parse_args(argv)

    from fate_lab.model.adapters import adapt
    from fate_lab.model.checkpoint import _load
    from fate_lab.offloading.store import SafetensorsStore

    model = _model(args.layers, args.experts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(folder, max_shard_size=max(1, total // args.shards))
        shards = sorted(folder.glob("*.safetensors"))
        header_kib = [int.from_bytes(f.read_bytes()[:8], "little") / 1024 for f in shards]
        a = adapt(model)
        ssd = _open_s(model, folder, "instant", args.repeats)
        disk = _open_s(model, folder, "disk", args.repeats)
        store = SafetensorsStore.open(a, folder)
        pairs = [(i % a.num_moe_layers, (i * 7) % a.num_experts) for i in range(args.reads)]
        per_read = {"kept open": [], "one open per tensor": []}
        for _ in range(args.repeats):  # interleaved
            t = time.perf_counter()
            for m, e in pairs:
                store.fetch(m, e)
            per_read["kept open"].append((time.perf_counter() - t) / len(pairs))
            t = time.perf_counter()
            for m, e in pairs:
                store.index.read(m, e, load=_load)
            per_read["one open per tensor"].append((time.perf_counter() - t) / len(pairs))

    def fmt(xs, scale, unit):
        return f"{statistics.median(xs) * scale:.3g} {unit} ({min(xs) * scale:.3g}-{max(xs) * scale:.3g})"

    lines = [f"# Opening a checkpoint of {a.num_moe_layers} MoE layers x {a.num_experts} experts "
             f"({a.num_moe_layers * a.num_experts * 3} expert tensors, {len(shards)} shards, headers "
             f"{min(header_kib):.0f}-{max(header_kib):.0f} KiB each)", "",
             f"`python -m benchmarks.bench_checkpoint_open` (median, min-max of {args.repeats} runs)", "",
             "| call | time |", "|---|---|",
             f"| `offload(..., store='ssd', link='instant')` (verifies every expert) | {fmt(ssd, 1, 's')} |",
             f"| `offload(..., store='ssd', link='disk')` (+ locates every expert's byte ranges) | "
             f"{fmt(disk, 1, 's')} |",
             f"| one expert read, `SafetensorsStore.fetch` (files kept open) | "
             f"{fmt(per_read['kept open'], 1e3, 'ms')} |",
             f"| the same read, one `safe_open` per tensor (every read before) | "
             f"{fmt(per_read['one open per tensor'], 1e3, 'ms')} |"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
