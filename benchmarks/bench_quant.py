"""Reconstruction error, bytes and speed of every quantization scheme, then model quality.

Part 1 quantizes every routed expert of the model at each (bits, group, refine) and prints, per
scheme: stored bits per weight, bytes per expert and the ratio to fp16, mean/max absolute and
relative Frobenius error, and quantize/dequantize time per expert on this machine's CPU.
Part 2 (with a tokenizer and the corpus) puts perplexity, greedy agreement and mean KL to the
full-precision model on held-out text next to each scheme, including Fate's INT4 cache and
its INT2 worst case (every expert as a miss), and shallow layers kept at INT8.
Part 3 (`--speed`, needs a tokenizer) decodes a held-out prompt in the real runtime with
`fate`, `fate_int8` and `fate_quant` under each scaled link profile: bytes moved per decode
token, decode tok/s and whether the greedy tokens match full precision.

    python -m benchmarks.bench_quant                         # embedded model (data/tiny_moe)
    python -m benchmarks.bench_quant --random                # random model of the embedded shape
    python -m benchmarks.bench_quant --model /path/to/moe --tokens 4096
    python -m benchmarks.bench_quant --speed --new-tokens 32   # + runtime speed per link

Nothing is asserted; the numbers feed notebook 06_quantization.
"""
from __future__ import annotations

import argparse
import time

import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.model.adapters import adapt
from fate_lab.quant import QuantPolicy, QuantSpec, expert_nbytes, quality_report, quantize, quantize_model_experts

SCHEMES = [QuantSpec(8, 64), QuantSpec(4, 32), QuantSpec(4, 64), QuantSpec(4, 128), QuantSpec(3, 64),
           QuantSpec(2, 16), QuantSpec(2, 32), QuantSpec(2, 64), QuantSpec(4, 64, refine=True),
           QuantSpec(3, 64, refine=True), QuantSpec(2, 32, refine=True)]


def _spec_name(spec: QuantSpec | None) -> str:
    """Short label of a spec, e.g. int4/g64/hqq."""
    if spec is None:
        return "fp"
    return f"int{spec.bits}/g{spec.group_size}" + ("/hqq" if spec.refine else "")


def reconstruction_table(model) -> list[dict]:
    """One row per scheme: bytes and error over all routed experts, and per-expert timings."""
    ad = adapt(model)
    fused = [(getattr(ad.experts_module(m), n).data.float()) for m in range(ad.num_moe_layers)
             for n in ("gate_up_proj", "down_proj")]  # (E, 2I, H) and (E, H, I) per layer
    one = {k: v.float() for k, v in ad.expert_weights(0, 0).items()}
    fp16_bytes = expert_nbytes({k: v.shape for k, v in one.items()}, None, dtype=torch.float16)
    rows = []
    for spec in SCHEMES:
        abs_sum = sq_err = sq_ref = 0.0
        max_abs, n = 0.0, 0
        for w in fused:
            w_hat = quantize(w, spec).dequantize()
            err = w_hat - w
            abs_sum += err.abs().sum().item()
            max_abs = max(max_abs, err.abs().max().item())
            sq_err += err.pow(2).sum().item()
            sq_ref += w.pow(2).sum().item()
            n += w.numel()
        t0 = time.perf_counter()
        q = {k: quantize(v, spec) for k, v in one.items()}
        t1 = time.perf_counter()
        for _ in range(5):
            [x.dequantize() for x in q.values()]
        t2 = time.perf_counter()
        nbytes = sum(x.nbytes() for x in q.values())
        assert nbytes == expert_nbytes(one, spec)
        rows.append(dict(scheme=_spec_name(spec), bits_per_weight=spec.bits_per_weight, bytes_per_expert=nbytes,
                         vs_fp16=nbytes / fp16_bytes, mean_abs=abs_sum / n, max_abs=max_abs,
                         rel_fro=(sq_err / sq_ref) ** 0.5, quant_ms=1e3 * (t1 - t0), dequant_ms=1e3 * (t2 - t1) / 5))
    return rows


def token_batches(tokenizer, n_tokens: int, seq_len: int) -> list[torch.Tensor]:
    """Held-out corpus text cut into [1, seq_len] token windows, n_tokens in all."""
    from fate_lab.model.corpus import heldout_texts

    ids: list[int] = []
    for text in heldout_texts():
        ids += tokenizer(text)["input_ids"]
        if len(ids) >= n_tokens:
            break
    ids = ids[: n_tokens - n_tokens % seq_len]
    return [torch.tensor(ids[i:i + seq_len]).unsqueeze(0) for i in range(0, len(ids), seq_len)]


def quality_table(model, batches: list[torch.Tensor]) -> list[dict]:
    """One row per scheme/policy: perplexity, greedy agreement and mean KL against full precision."""
    int8 = QuantSpec.preset("int8")
    fate = QuantPolicy.preset("fate")
    cases: list[tuple[str, object, str]] = [(_spec_name(s), s, "cache") for s in SCHEMES]
    cases += [("fate cache (int4)", fate, "cache"), ("fate all-miss (int2)", fate, "miss"),
              ("fate all-miss, shallow 2 at int8", fate.with_shallow(2, int8), "miss")]
    rows = []
    for name, scheme, reason in cases:
        q_model = quantize_model_experts(model, scheme, reason=reason)
        rows.append(dict(scheme=name, **quality_report(model, q_model, batches)))
        del q_model
    return rows


SPEED_LINKS = ("qwen15_moe_rtx3090_pcie3", "qwen15_moe_rtx3090_pcie4", "deepseek_moe_1080ti_pcie1")


def speed_table(model, input_ids: torch.Tensor, new_tokens: int, cache_share: float = 0.25,
                links: tuple[str, ...] = SPEED_LINKS) -> list[dict]:
    """One row per (link, preset): MiB per decode token, decode tok/s, hit rate, same tokens as `fate`."""
    from fate_lab.offloading.runtime import calibrate_layer_time
    from fate_lab.study.bench import run_preset

    ad = adapt(model)
    slots = int(cache_share * ad.num_moe_layers * ad.num_experts)
    layer_s = calibrate_layer_time(model)  # once: every run scales its link from the same layer time
    rows = []
    for link in links:
        ref = None
        for preset in ("fate", "fate_int8", "fate_quant"):
            cfg = OffloadConfig.preset(preset, slots=slots, link=link, layer_compute_s=layer_s)
            run = run_preset(model, input_ids, cfg, new_tokens)
            ref = run["tokens"] if ref is None else ref
            r = run["row"]
            rows.append(dict(link=link, preset=preset, slots=slots,
                             mib_per_decode_token=r["MiB moved per token"], decode_tok_s=r["decode tok/s"],
                             ttft_ms=r["TTFT (ms)"], hit_rate=r["decode hit rate"],
                             same_tokens_as_fate=run["tokens"] == ref))
    return rows


def _print_table(rows: list[dict]) -> None:
    """Rows as a markdown table."""
    keys = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(fmt(r[k]) for k in keys) + " |")


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run both parts, print markdown tables."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="local HF MoE checkpoint (default: embedded data/tiny_moe)")
    p.add_argument("--random", action="store_true", help="a random qwen2_moe of the embedded model's shape")
    p.add_argument("--tokens", type=int, default=2048, help="held-out tokens for the quality table")
    p.add_argument("--seq-len", type=int, default=256,
                   help="tokens per sequence of the quality table (default %(default)s)")
    p.add_argument("--speed", action="store_true", help="also time fate / fate_int8 / fate_quant in the runtime")
    p.add_argument("--new-tokens", type=int, default=32, help="decode length of the speed runs")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.random:
        from fate_lab.model.testing import tiny_model

        model, tokenizer = tiny_model("qwen2_moe", hidden_size=256, num_hidden_layers=8, num_experts=32,
                                      num_experts_per_tok=4, moe_intermediate_size=128,
                                      shared_expert_intermediate_size=256), None
    else:
        from fate_lab.model.models import load_model

        model, tokenizer = load_model(args.model)
    print(f"## Reconstruction error over all routed experts ({adapt(model).num_moe_layers} MoE layers)\n")
    _print_table(reconstruction_table(model))
    if tokenizer is None:  # a random model reads random ids: only agreement and KL mean something
        gen = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, model.config.vocab_size, (1, args.seq_len), generator=gen)
                   for _ in range(max(1, args.tokens // args.seq_len))]
        source = "random"
    else:
        batches = token_batches(tokenizer, args.tokens, args.seq_len)
        source = "held-out"
    print(f"\n## Quality on {sum(b.numel() for b in batches)} {source} tokens\n")
    _print_table(quality_table(model, batches))
    if args.speed and tokenizer is not None:
        from fate_lab.model.corpus import heldout_prompts

        ids = tokenizer(heldout_prompts(1, max_chars=300)[0], return_tensors="pt")["input_ids"]
        print(f"\n## Runtime speed, {args.new_tokens} greedy tokens, cache a quarter of the experts\n")
        _print_table(speed_table(model, ids, args.new_tokens))


if __name__ == "__main__":
    main()
