"""Side-by-side runs of offloading configs: measured in the runtime, predicted by the simulator, one table.

What it is: `side_by_side(model, tokenizer, prompts, configs, link, slots)` -- the table notebook 07
and `benchmarks/bench_beyond_fate.py` show: for every config, greedy generation of the same prompts
through the real offloaded runtime (decode tok/s, TTFT, decode hit rate, experts moved per decode
token, stall, host calls, and whether the tokens equal the plain model's), with the timed simulator's
prediction for the same config on a trace of the same prompts, on this machine calibrated ONCE per precision
(`whatif.machine_hardware`: one layer time scales the runtime's link and the simulator's alike; a quantized config
is predicted from a calibration with its experts packed, as `whatif.hardware_for` picks it).
What it is not: a claim about speed on its own; the rows are ratios measured in one run.
"""
from __future__ import annotations

import pandas as pd
import torch

from fate_lab.policy.registry import policy_names


def _greedy_ids(model, ids: list[int], new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=model.generation_config.pad_token_id or 0)
    return out[0, len(ids):].tolist()


def runtime_row(model, prompts: list[list[int]], config, new_tokens: int, reference: list[list[int]] | None = None
                ) -> dict:
    """One config in the runtime: greedy generate of every prompt, its `RunStats.row` (and whether the tokens
    equal the plain model's `reference`)."""
    from fate_lab.offloading.runtime import offload
    from fate_lab.study.clock import pinned

    with pinned(), offload(model, config) as rt:  # torch's threads held while measuring (study/clock.py)
        _greedy_ids(model, prompts[0][:8], 3)  # warm-up (its counters are dropped)
        rt.reset_stats()
        outs = [_greedy_ids(model, p, new_tokens) for p in prompts]
        row = rt.stats.row(config.name)
    if reference is not None:
        row["same tokens as plain"] = outs == reference
    return row


def side_by_side(model, tokenizer, prompts: list[str], configs: dict, link: str = "qwen15_moe_rtx3090_pcie3",
                 slots: int | None = None, new_tokens: int = 24, max_prompt_tokens: int = 32,
                 simulate_too: bool = True, repeats: int = 1) -> pd.DataFrame:
    """Every config of `configs` (name -> OffloadConfig) measured in the runtime and predicted by the simulator,
    on the same prompts, link and cache size (`slots`; None keeps each config's own). With ``repeats`` > 1 the
    configs run in that many rounds; each row is its median round, with ``decode tok/s spread`` over the rounds
    (`clock.spread`), and its tokens must equal the plain model's in every round."""
    from tqdm.auto import tqdm

    from fate_lab.core.shape import ModelShape
    from fate_lab.model.adapters import adapt
    from fate_lab.model.record import record_trace
    from fate_lab.sim.simulate import simulate
    from fate_lab.study.whatif import hardware_for, machine_hardware

    ids = [tokenizer(p)["input_ids"][:max_prompt_tokens] for p in prompts]
    if not ids or any(len(i) < 2 for i in ids):
        raise ValueError("side_by_side needs prompts of at least 2 tokens")
    hw, layer_s = machine_hardware(model, tokenizer, link)
    hws = {None: hw}
    reference = [_greedy_ids(model, p, new_tokens) for p in ids]
    trace = record_trace(model, tokenizer, ids, decode_tokens=new_tokens - 1, progress=False) if simulate_too else None
    shape = ModelShape.from_adapter(adapt(model))
    from fate_lab.study.clock import spread

    over = {"link": link, "layer_compute_s": layer_s}
    if slots is not None:
        over.update(slots=slots, budget=None)
    configs = {name: cfg.replace(**over) for name, cfg in configs.items()}
    rounds: dict[str, list[dict]] = {name: [] for name in configs}
    with tqdm(total=repeats * len(configs), desc="configs", unit="run") as bar:
        for _ in range(repeats):
            for name, cfg in configs.items():
                rounds[name].append({**runtime_row(model, ids, cfg, new_tokens, reference), "config": name})
                bar.update()
    rows = []
    for name, cfg in configs.items():
        rs = sorted(rounds[name], key=lambda r: r["decode tok/s"])
        row = dict(rs[len(rs) // 2])
        row["decode tok/s spread"] = spread([r["decode tok/s"] for r in rs]) if repeats > 1 else float("nan")
        row["same tokens as plain"] = all(r["same tokens as plain"] for r in rs)
        if simulate_too:  # a quantized config from a calibration at its own precision (`whatif.hardware_for`)
            if cfg.quant not in hws:
                hws[cfg.quant] = machine_hardware(model, tokenizer, link, quant=cfg.quant)[0]
            res = simulate(trace, cfg, hardware_for(hws, cfg), shape)
            row["simulated tok/s"] = res.decode_tok_s
            row["sim / runtime"] = res.decode_tok_s / row["decode tok/s"]
            row["simulated hit rate"] = res.hit_rate("decode")
        rows.append(row)
    return pd.DataFrame(rows).set_index("config")


def markdown(df: pd.DataFrame, digits: int = 3) -> str:
    """A DataFrame as a GitHub markdown table (index first), numbers to `digits` significant digits."""
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.{digits}g}"
        return str(v)

    head = [df.index.name or ""] + [str(c) for c in df.columns]
    rows = [[str(i)] + [cell(v) for v in r] for i, r in zip(df.index, df.itertuples(index=False), strict=True)]
    return "\n".join("| " + " | ".join(r) + " |" for r in [head, ["---"] * len(head), *rows])



REPLACEMENTS = (*policy_names("classic"), "router_ema")  # the classic policies and the project's own


def replacement_table(trace, shape, hardware, shares=(0.25, 0.5), policies=REPLACEMENTS) -> pd.DataFrame:
    """Decode hit rate of each replacement policy, with Belady's offline bound: in the replay (the cache
    alone, uniform slots, no prefetch) and in the simulator running fate's pipeline with only the
    replacement changed (predicted decode tok/s beside). One row per (view, share)."""
    from fate_lab.core.config import OffloadConfig
    from fate_lab.sim.replay import replay
    from fate_lab.sim.simulate import simulate

    total = shape.num_moe_layers * shape.num_experts
    rows = []
    for share in shares:
        per_layer = int(total * share) // shape.num_moe_layers
        hit = {p: replay(trace, slots_per_layer=per_layer, policy=p).hit_rate("decode")
               for p in (*policies, "belady")}
        rows.append({"view": "replay (cache only)", "cached": share, **hit})
        sims = {p: simulate(trace, OffloadConfig.preset("fate", slots=int(total * share), replacement=p), hardware,
                            shape) for p in policies}
        rows.append({"view": "simulator (fate pipeline)", "cached": share,
                     **{p: r.hit_rate("decode") for p, r in sims.items()},
                     **{f"{p} tok/s": r.decode_tok_s for p, r in sims.items()}})
    df = pd.DataFrame(rows)
    best = df[list(policies)].idxmax(axis=1)
    df["best"] = best
    df["best - arc (pts)"] = [100 * (r[b] - r["arc"]) for (_, r), b in zip(df.iterrows(), best, strict=True)]
    df["belady - best (pts)"] = [100 * (r["belady"] - r[b]) if pd.notna(r.get("belady")) else float("nan")
                                 for (_, r), b in zip(df.iterrows(), best, strict=True)]
    return df.set_index(["view", "cached"])
