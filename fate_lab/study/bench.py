"""Timing of ``generate`` with and without the offloaded runtime, for notebooks and benchmarks.

What it is: ``time_generate`` (greedy, fixed length; every forward timed from its start to its end, as the
runtime and the simulator time theirs), ``run_preset`` (one `OffloadConfig`: offload, generate, the runtime's
`RunStats.row`, close) and ``compare_presets`` (a table of configs against plain generate, measured in one
run over one calibrated link). Speeds are forward times: time to first token is the prefill forward, decode
tok/s is decode forwards per second of decode forward time -- the quantity the simulator predicts.
What it is not: an assertion of speed. Machines are shared and noisy; report the ratios.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import pandas as pd
import torch

from fate_lab.core.config import OffloadConfig


@dataclass(frozen=True)
class GenerateTiming:
    """One greedy generate: the tokens, time to first token and decode rate (forward times)."""

    tokens: list[int]  # generated ids (prompt excluded)
    ttft_s: float  # the prefill forward
    decode_tok_s: float  # decode forwards per second of decode forward time


def time_generate(model, input_ids: torch.Tensor, new_tokens: int, repeats: int = 1) -> GenerateTiming:
    """Greedy ``generate`` of exactly ``new_tokens``; the run with the median decode rate of ``repeats``."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens!r}: give an int >= 2 to time decoding")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: give an int >= 1")
    runs = []
    for _ in range(repeats):
        spans: list[list[float]] = []
        pre = model.register_forward_pre_hook(lambda *_: spans.append([time.perf_counter()]))
        post = model.register_forward_hook(lambda *_: spans[-1].append(time.perf_counter()))
        try:
            out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=model.generation_config.pad_token_id or 0)
        finally:
            pre.remove()
            post.remove()
        dur = [s[1] - s[0] for s in spans]
        runs.append(GenerateTiming(out[0, input_ids.shape[1]:].tolist(), dur[0], (len(dur) - 1) / sum(dur[1:])))
    runs.sort(key=lambda r: r.decode_tok_s)
    return runs[len(runs) // 2]


def run_preset(model, input_ids: torch.Tensor, config: OffloadConfig, new_tokens: int, repeats: int = 1) -> dict:
    """Offload with `config`, time greedy generate, and return its `RunStats.row`, the tokens, the timeline
    and the per-layer rows (the repeat with the median decode rate)."""
    from fate_lab.offloading.runtime import offload

    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig (e.g. OffloadConfig.preset('fate', slots=64)), got "
                        f"{type(config).__name__}")
    rt = offload(model, config)
    try:
        runs = []
        for _ in range(repeats):
            rt.reset_stats()
            timing = time_generate(model, input_ids, new_tokens)
            runs.append({"row": {**rt.stats.row(config.name), "link": rt.stats.link,
                                 "slots per layer": list(rt.slots_per_layer)},
                         "tokens": timing.tokens, "timeline": list(rt.stats.timeline), "layers": rt.stats.rows()})
        runs.sort(key=lambda r: r["row"]["decode tok/s"])
        best = runs[len(runs) // 2]
        rates = [r["row"]["decode tok/s"] for r in runs]
        best["row"]["decode tok/s spread"] = (max(rates) - min(rates)) / statistics.median(rates) if repeats > 1 \
            else float("nan")
        return best
    finally:
        rt.close()


def calibrated(model, configs: dict[str, OffloadConfig]) -> dict[str, OffloadConfig]:
    """The configs with ONE layer time for every scaled link that has none: every row then runs over one link."""
    from fate_lab.hardware.setups import is_scaled
    from fate_lab.offloading.runtime import calibrate_layer_time

    layer_s = None
    out = {}
    for name, cfg in configs.items():
        if is_scaled(cfg.link) and cfg.layer_compute_s is None:
            layer_s = layer_s or calibrate_layer_time(model, steps=24)
            cfg = dataclasses.replace(cfg, layer_compute_s=layer_s)
        out[name] = cfg
    return out


def compare_presets(model, input_ids: torch.Tensor, configs: dict[str, OffloadConfig], new_tokens: int,
                    repeats: int = 1) -> tuple[pd.DataFrame, dict]:
    """Every config (name -> OffloadConfig) and plain generate on the same prompt; ratios vs all_resident and
    load_on_demand when present. A scaled link is calibrated once here for the configs that pin none."""
    from tqdm.auto import tqdm

    configs = calibrated(model, configs)
    plain = time_generate(model, input_ids, new_tokens, repeats)
    rows = [{"config": "plain generate", "driver": "plain", "decode tok/s": plain.decode_tok_s,
             "TTFT (ms)": 1e3 * plain.ttft_s}]
    runs = {"plain generate": {"tokens": plain.tokens}}
    for name, cfg in tqdm(configs.items(), desc="configs", unit="config"):
        runs[name] = run_preset(model, input_ids, cfg, new_tokens, repeats)
        rows.append({**runs[name]["row"], "config": name})
    df = pd.DataFrame(rows).set_index("config")
    df["same tokens as plain"] = [runs[n]["tokens"] == plain.tokens for n in df.index]
    for ref in ("all_resident", "load_on_demand"):
        if ref in df.index:
            df[f"speed vs {ref}"] = df["decode tok/s"] / df.loc[ref, "decode tok/s"]
    return df, runs


def timeline_frame(timeline: list[tuple], max_events: int | None = 400) -> pd.DataFrame:
    """Runtime timeline events as a table (kind, lane, t_start, t_end) starting at 0, for ``plots.timeline``."""
    df = pd.DataFrame(timeline, columns=["kind", "layer", "expert", "t_start", "t_end"])
    if df.empty:
        return df.assign(lane=[])
    if max_events is not None:
        df = df.iloc[-max_events:]
    t0 = df["t_start"].min()
    df = df.assign(t_start=df["t_start"] - t0, t_end=df["t_end"] - t0)
    df["lane"] = [_LANES.get(k, k) for k in df["kind"]]
    return df.sort_values(["lane", "t_start"])


_LANES = {"compute": "device: expert compute", "stall": "device: waiting on link", "prefetch": "link (host→device)",
          "demand": "link (host→device)", "sync_load": "link (host→device)"}
