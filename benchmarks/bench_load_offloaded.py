"""Peak host memory of opening a checkpoint offloaded (`load_offloaded`, store="ssd") against loading it whole.

Run: `OMP_NUM_THREADS=1 python -m benchmarks.bench_load_offloaded` (about two minutes on one core). It writes a
tiny random Mixtral whose routed experts are ~95% of its bytes (fp32, hidden 256, 16 experts of width 1024 in
each of 16 layers: ~830 MB) into a temporary folder, then in two fresh subprocesses (each imports the same
modules, so the interpreter's own memory is the same in both) it (a) loads it with `load_model` and greedy-
decodes 24 tokens, (b) opens it with `load_offloaded` with 10% of the experts cached and decodes the same 24
tokens; each reports its peak resident set (VmHWM, which counts the file pages mapped while an expert is read).
Then it times the SSD tier's digest (`offloading/digest.expert_digest`, XXH3-64) per GB. Writes
`benchmarks/results/load_offloaded_<date>.md`; exits 1 if the tokens differ or the ratio misses 0.35.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.35  # target: offloaded peak RSS under 0.35x of plain loading
SIZES = dict(hidden_size=256, intermediate_size=1024, num_local_experts=16, num_experts_per_tok=2,
             num_hidden_layers=16, vocab_size=8192, num_attention_heads=4, num_key_value_heads=2)
TOKENS = 24


def _write_checkpoint(folder: Path) -> dict:
    """The tiny big-expert Mixtral, saved with the embedded model's tokenizer; its byte counts."""
    from fate_lab.model.adapters import adapt
    from fate_lab.model.testing import tiny_model
    from fate_lab.paths import EMBEDDED_MODELS

    model = tiny_model("mixtral", seed=0, **SIZES)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODELS["tiny_moe"] / name, folder / name)
    a = adapt(model)
    return {"expert_bytes": a.expert_bytes_total(), "dense_bytes": a.dense_bytes(), "experts": a.num_moe_layers *
            a.num_experts, "file_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}


def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: reset at exec, unlike ru_maxrss, which keeps the parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status: this benchmark needs Linux")


def _child(mode: str, folder: Path) -> dict:
    """In a fresh process: load one way, greedy-decode TOKENS tokens; peak RSS and the tokens."""
    import torch

    from fate_lab.core.config import OffloadConfig
    from fate_lab.model.models import load_model
    from fate_lab.offloading.load import load_offloaded

    base_mb = _peak_rss_mb()  # after the imports: the interpreter's own
    t0 = time.perf_counter()
    if mode == "plain":
        model, _ = load_model(folder)
        rt = None
    else:
        slots = SIZES["num_hidden_layers"] * SIZES["num_local_experts"] // 10  # 10% of the experts
        model, _, rt = load_offloaded(folder, OffloadConfig.preset("fate", store="ssd", slots=slots, link="instant"))
    t_load = time.perf_counter() - t0
    ids = torch.arange(5, 17).reshape(1, -1)  # (1, 12)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
    info = {"mode": mode, "peak_rss_mb": _peak_rss_mb(),
            "base_rss_mb": base_mb, "load_s": t_load, "tokens": out[0, ids.shape[1]:].tolist()}
    if rt is not None:
        info["slots"] = sum(rt.slots_per_layer)
        info["decode_hits"] = rt.stats.summary()["decode"]["hits"]
        rt.close()
    return info


def _digest_cost(gib: float = 1.0, repeats: int = 3) -> float:
    """Seconds per GB of `expert_digest` over fp32 expert-sized tensors, best of repeats (warm memory)."""
    import torch

    from fate_lab.model.experts import ExpertWeights
    from fate_lab.offloading.digest import expert_digest

    n = int(gib * 2**30 / 4 / 3)
    w = ExpertWeights(torch.randn(2 * n // 3, 1), torch.randn(n // 3, 1))  # ~1 GiB in two contiguous tensors
    nbytes = w.nbytes()
    expert_digest(w)  # touch the pages
    best = min(_timed(lambda: expert_digest(w)) for _ in range(repeats))
    return best / (nbytes / 1e9)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _run(mode: str, folder: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.bench_load_offloaded", "--child", mode, "--folder", str(folder)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True, timeout=1200)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Measure both ways in subprocesses and write the results table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=("plain", "offloaded"), help=argparse.SUPPRESS)
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/results/...)")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.folder)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "big_experts_mixtral"
        sizes = _write_checkpoint(folder)
        plain, off = _run("plain", folder), _run("offloaded", folder)
    per_gb = _digest_cost()
    ratio = off["peak_rss_mb"] / plain["peak_rss_mb"]
    above = (off["peak_rss_mb"] - off["base_rss_mb"]) / (plain["peak_rss_mb"] - plain["base_rss_mb"])
    same = plain["tokens"] == off["tokens"]
    date = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"load_offloaded_{date}.md"
    mb = 1e6
    p, o = plain, off
    text = f"""# Opening a checkpoint offloaded: peak host memory ({date})

Command: `OMP_NUM_THREADS=1 python -m benchmarks.bench_load_offloaded` (CPU, torch {__import__('torch').__version__}).
Checkpoint: a tiny random Mixtral (`{SIZES}`), fp32, {sizes['file_bytes'] / mb:.0f} MB on disk: routed experts
{sizes['expert_bytes'] / mb:.0f} MB ({sizes['experts']} experts), everything else {sizes['dense_bytes'] / mb:.1f} MB.
Each way runs in a fresh subprocess that imports the same modules, then loads and greedy-decodes {TOKENS} tokens.
`load_offloaded` uses the `fate` preset, store="ssd", {off['slots']} cache slots (10% of the experts), the
instant link (every transfer is a read of the safetensors file, memory-mapped, one expert at a time).

| | peak RSS (MB) | after imports (MB) | peak above imports (MB) | load (s) |
|---|---|---|---|---|
| `load_model` | {p['peak_rss_mb']:.0f} | {p['base_rss_mb']:.0f} | \
{p['peak_rss_mb'] - p['base_rss_mb']:.0f} | {p['load_s']:.2f} |
| `load_offloaded` (ssd, 10% cached) | {o['peak_rss_mb']:.0f} | {o['base_rss_mb']:.0f} | \
{o['peak_rss_mb'] - o['base_rss_mb']:.0f} | {o['load_s']:.2f} |

Peak RSS offloaded / plain: **{ratio:.3f}** (target < {TARGET}); above the interpreter's own: {above:.3f}.
Tokens: {'identical' if same else 'DIFFERENT'} ({TOKENS} greedy tokens; {off['decode_hits']} decode hits).
The offloaded load time includes reading every expert once to take its digest (the file is the only copy).

SSD-tier digest (XXH3-64 over every byte of an expert, `offloading/digest.py`): {per_gb:.3f} s per GB on one core
here ({1 / per_gb:.1f} GB/s), paid once per expert at offload and again on every read of an expert from the file.
"""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0 if same and ratio < TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
