"""Timing of ``generate`` with and without the offloaded runtime, for notebooks and benchmarks.

What it is: ``time_generate`` (TTFT and decode tokens/s from forward hooks, greedy, fixed
length), ``run_preset`` (one preset: offload, generate, collect the runtime's stats, close) and
``compare_presets`` (a table of every preset against plain generate, measured in one run).
What it is not: an assertion of speed. Machines are shared and noisy; report the ratios.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd
import torch


@dataclass(frozen=True)
class GenerateTiming:
    """One greedy generate: the tokens, time to first token and decode rate."""

    tokens: list[int]  # generated ids (prompt excluded)
    ttft_s: float  # start of generate -> end of the prefill forward
    decode_tok_s: float  # decode forwards per second after the first token


def time_generate(model, input_ids: torch.Tensor, new_tokens: int, repeats: int = 1) -> GenerateTiming:
    """Greedy ``generate`` of exactly ``new_tokens``; best decode rate of ``repeats`` runs."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to time decoding, got {new_tokens}")
    best = None
    for _ in range(repeats):
        ends: list[float] = []
        h = model.register_forward_hook(lambda *_: ends.append(time.perf_counter()))
        try:
            t0 = time.perf_counter()
            out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=model.generation_config.pad_token_id or 0)
        finally:
            h.remove()
        run = GenerateTiming(out[0, input_ids.shape[1]:].tolist(), ends[0] - t0, (len(ends) - 1) / (ends[-1] - ends[0]))
        if best is None or run.decode_tok_s > best.decode_tok_s:
            best = run
    return best


def run_preset(model, input_ids: torch.Tensor, preset: str, new_tokens: int, repeats: int = 1, **overrides) -> dict:
    """Offload with a preset, time greedy generate, and return a row of speed + runtime stats."""
    from fate_lab.offloading.runtime import OffloadConfig, offload

    rt = offload(model, OffloadConfig.preset(preset, **overrides))
    try:
        rt.reset_stats()
        timing = time_generate(model, input_ids, new_tokens, repeats)
        s = rt.stats.summary()
        d, p = s["decode"], s["prefill"]
        row = {
            "preset": preset, "decode tok/s": timing.decode_tok_s, "TTFT (ms)": 1e3 * timing.ttft_s,
            "hit rate decode": d["hit_rate"], "hit rate prefill": p["hit_rate"],
            "stall decode (ms/token)": 1e3 * d["stall_s"] / max(d["forwards"], 1),
            "prefetch recall": d["recall"], "prefetch precision": d["precision"], "predicted set": d["set_size"],
            "MiB moved per decode token": (d["bytes_moved"] / max(d["forwards"], 1)) / 2**20,
            "slots": list(rt.slots_per_layer), "link": rt.stats.link,
        }
        return {"row": row, "tokens": timing.tokens, "timeline": list(rt.stats.timeline), "layers": rt.stats.rows()}
    finally:
        rt.close()


def compare_presets(model, input_ids: torch.Tensor, presets: list[str], new_tokens: int, repeats: int = 1,
                    **overrides) -> tuple[pd.DataFrame, dict]:
    """Every preset (and plain generate) on the same prompt; ratios vs all_resident and load_on_demand.

    A scaled link is calibrated once here unless ``layer_compute_s`` is given, so the rows cannot run
    over different links (each row's ``link`` column says which it ran over).
    """
    from tqdm.auto import tqdm

    from fate_lab.offloading.config import OffloadConfig
    from fate_lab.offloading.links import LINK_PROFILES
    from fate_lab.offloading.runtime import calibrate_layer_time

    link = overrides.get("link", OffloadConfig().link)
    if link not in LINK_PROFILES and link != "instant" and overrides.get("layer_compute_s") is None:
        # a scaled link is calibrated ONCE for the whole table: every row runs over the same link
        overrides = dict(overrides, layer_compute_s=calibrate_layer_time(model, steps=24))
    plain = time_generate(model, input_ids, new_tokens, repeats)
    rows = [{"preset": "plain generate", "decode tok/s": plain.decode_tok_s, "TTFT (ms)": 1e3 * plain.ttft_s}]
    runs = {"plain generate": {"tokens": plain.tokens}}
    for name in tqdm(presets, desc="presets", unit="preset"):
        runs[name] = run_preset(model, input_ids, name, new_tokens, repeats, **overrides)
        rows.append(runs[name]["row"])
    df = pd.DataFrame(rows).set_index("preset")
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
