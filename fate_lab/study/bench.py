"""Timing of ``generate`` with and without the offloaded runtime, for notebooks and benchmarks.

What it is: ``time_generate`` (greedy, fixed length; every forward timed from its start to its end, as the
runtime and the simulator time theirs), ``run_preset`` (one `OffloadConfig`: offload, generate, the runtime's
`RunStats.row`, close) and ``compare_presets`` (a table of configs against plain generate, measured in one
run over one calibrated link). Speeds are forward times: time to first token is the prefill forward, decode
tok/s is decode forwards per second of decode forward time -- the quantity the simulator predicts.
What it is not: an assertion of speed. Machines are shared and noisy; report the ratios.
"""
from __future__ import annotations

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
    from fate_lab.study.clock import pinned

    runs = []
    for _ in range(repeats):
        spans: list[list[float]] = []
        pre = model.register_forward_pre_hook(lambda *_, spans=spans: spans.append([time.perf_counter()]))
        post = model.register_forward_hook(lambda *_, spans=spans: spans[-1].append(time.perf_counter()))
        try:
            with pinned():
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
    """Offload with `config`, time greedy generate `repeats` times (torch threads pinned; every repeat on a
    fresh runtime, so each starts with an empty cache), and return the `RunStats.row` of the repeat with the
    median decode rate (with ``decode tok/s spread``, the relative
    half-range over the repeats; NaN for one), the tokens, the timeline and the per-layer rows."""
    from fate_lab.offloading.runtime import offload
    from fate_lab.study.clock import pinned, spread

    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig (e.g. OffloadConfig.preset('fate', slots=64)), got "
                        f"{type(config).__name__}")
    from fate_lab.study.auto import resolve

    name = config.name
    if config.auto is not None:  # a plan request is planned once, on this model, not per repeat
        config = resolve(config, model=model)
    with pinned():
        with offload(model, config):  # warm-up in a runtime of its own: the first forwards allocate, and a
            time_generate(model, input_ids[:, :8], 2)  # warm-up in the measured one would warm its cache
        runs = []
        for _ in range(repeats):  # every repeat starts cold, as the simulator's run of the trace does
            rt = offload(model, config)
            try:
                timing = time_generate(model, input_ids, new_tokens)
                runs.append({"row": {**rt.stats.row(name), "link": rt.stats.link,
                                     "slots per layer": list(rt.slots_per_layer)},
                             "tokens": timing.tokens, "timeline": list(rt.stats.timeline), "layers": rt.stats.rows()})
            finally:
                rt.close()
    runs.sort(key=lambda r: r["row"]["decode tok/s"])
    best = runs[len(runs) // 2]
    best["row"]["decode tok/s spread"] = spread([r["row"]["decode tok/s"] for r in runs]) if repeats > 1 \
        else float("nan")
    best["row"]["TTFT spread"] = spread([r["row"]["TTFT (ms)"] for r in runs]) if repeats > 1 else float("nan")
    return best


def calibrated(model, configs: dict[str, OffloadConfig]) -> dict[str, OffloadConfig]:
    """The configs with the run's ONE layer time (`clock.machine_clock`) for every scaled link that has none:
    every row then runs over one link."""
    from fate_lab.hardware.setups import is_scaled
    from fate_lab.study.clock import machine_clock

    out = {}
    for name, cfg in configs.items():
        if is_scaled(cfg.link.name) and cfg.layer_compute_s is None:
            cfg = cfg.replace(layer_compute_s=machine_clock(model).layer_s)
        out[name] = cfg
    return out


def compare_presets(model, input_ids: torch.Tensor, configs: dict[str, OffloadConfig], new_tokens: int,
                    repeats: int = 1) -> tuple[pd.DataFrame, dict]:
    """Every config (name -> OffloadConfig) and plain generate on the same prompt, in `repeats` rounds (each
    round times plain generate and then every config once, so that a slow spell of the machine hits them all
    alike); each row is its median run, with the spread over the rounds. Ratios vs all_resident and
    load_on_demand when present. A scaled link is calibrated once (the run's clock) for the configs that pin
    none."""
    from tqdm.auto import tqdm

    from fate_lab.study.clock import median, pinned, spread

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: give an int >= 1")
    configs = calibrated(model, configs)
    time_generate(model, input_ids[:, :8], 2)  # warm-up
    rounds: dict[str, list[dict]] = {"plain generate": [], **{n: [] for n in configs}}
    with tqdm(total=repeats * (len(configs) + 1), desc="timed runs", unit="run") as bar:
        for _ in range(repeats):
            with pinned():
                plain = time_generate(model, input_ids, new_tokens)
            rounds["plain generate"].append({"row": {"config": "plain generate", "driver": "plain",
                                                     "decode tok/s": plain.decode_tok_s,
                                                     "TTFT (ms)": 1e3 * plain.ttft_s}, "tokens": plain.tokens})
            bar.update()
            for name, cfg in configs.items():
                rounds[name].append(run_preset(model, input_ids, cfg, new_tokens))
                bar.update()
    rows, runs = [], {}
    for name, rs in rounds.items():
        rates = [r["row"]["decode tok/s"] for r in rs]
        ttfts = [r["row"]["TTFT (ms)"] for r in rs]
        mid = sorted(rs, key=lambda r: r["row"]["decode tok/s"])[len(rs) // 2]
        runs[name] = mid
        rows.append({**mid["row"], "config": name, "decode tok/s": median(rates), "TTFT (ms)": median(ttfts),
                     "decode tok/s spread": spread(rates) if repeats > 1 else float("nan"),
                     "TTFT spread": spread(ttfts) if repeats > 1 else float("nan")})
    df = pd.DataFrame(rows).set_index("config")
    df["same tokens as plain"] = [runs[n]["tokens"] == runs["plain generate"]["tokens"] for n in df.index]
    for ref in ("all_resident", "load_on_demand"):
        if ref in df.index:
            df[f"speed vs {ref}"] = df["decode tok/s"] / df.loc[ref, "decode tok/s"]
    return df, runs


def same_prefix(tokens: list[int], reference: list[int]) -> float:
    """The share of `tokens` before the first one that differs from `reference` (1.0: all the same)."""
    n = next((i for i, (x, y) in enumerate(zip(tokens, reference, strict=False)) if x != y),
             min(len(tokens), len(reference)))
    return n / len(tokens) if tokens else float("nan")


def ratio(table: pd.DataFrame, of: str, over: str, column: str = "decode tok/s") -> tuple[float, float]:
    """(ratio, spread) of two rows of a `compare_presets` table: of / over in `column`, with the sum of both
    rows' relative spreads (``<column> spread``; ``TTFT (ms)`` uses ``TTFT spread``) as the ratio's spread."""
    key = "TTFT spread" if column == "TTFT (ms)" else f"{column} spread"
    r = table.loc[of, column] / table.loc[over, column]
    s = table.loc[of, key] + table.loc[over, key] if key in table.columns else float("nan")
    return float(r), float(s)


def paired_ratio(model, input_ids: torch.Tensor, config: OffloadConfig, new_tokens: int,
                 rounds: int) -> tuple[float, float]:
    """`config`'s decode rate over plain generate's, from `rounds` interleaved pairs (each round times plain
    generate, then `config` on a fresh runtime, so a slow spell of the machine hits both alike): the mean of the
    per-round ratios and, relative to it, two standard errors of that mean (`verdict.mean_uncertainty`) -- the
    (value, spread) pair the verdict builders take. For a comparison whose answer hangs on a few percent
    (all experts resident against the plain model), where three rounds' half-range is too rough a spread."""
    from fate_lab.study.clock import pinned
    from fate_lab.study.verdict import mean_uncertainty

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 2:
        raise ValueError(f"rounds={rounds!r}: give an int >= 2 (a spread needs two rounds)")
    time_generate(model, input_ids[:, :8], 2)  # warm-up
    ratios = []
    for _ in range(rounds):
        with pinned():
            plain = time_generate(model, input_ids, new_tokens)
        ratios.append(run_preset(model, input_ids, config, new_tokens)["row"]["decode tok/s"] / plain.decode_tok_s)
    mean = sum(ratios) / len(ratios)
    return mean, mean_uncertainty(ratios) / mean


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
