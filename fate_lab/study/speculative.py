"""Speculative decoding with the offloaded MoE as the target: measured in the runtime, predicted by the simulator.

What this file is: the measurement of HF assisted generation (greedy; the draft proposes a
constant ``window`` of tokens, the target checks them in one forward) on an offloaded model:
``speculative_decode(model, draft, prompts, config, window, n)`` runs
``model.generate(ids, assistant_model=draft, do_sample=False, max_new_tokens=n)`` under
``offload(model, config)`` and returns one row -- generated tokens, verify forwards, acceptance,
expert transfers per generated token, decode tokens/s, hit rate -- and window 0 runs the plain
``fate`` decoding the same way (``compare_windows`` does both). The generate call is the user's
own: the window is set on the draft's ``generation_config`` (``num_assistant_tokens``, schedule
``"constant"``, confidence threshold 0 so no step stops early) and put back afterwards.

How a forward is counted: ``ForwardLog`` hooks the target model and records, per forward, the
tokens already in the KV cache, the tokens it processes and the runtime's counters around it.
A forward that starts an empty cache is the prefill (in assisted generation it also checks the
first proposals); every later one is a decode step (plain: one token; assisted: a verify step of
``1 + proposals`` tokens). Tokens produced per forward follow from the cache lengths (HF crops the
cache back to the accepted tokens after each verify step).

Also here: ``draft_matches`` (which proposals a draft would get accepted along a recorded greedy
trace, the exact input of ``sim.speculative``) and ``window_table`` / ``roofline_table`` (what the
window explorer of ``fate_lab.study.widgets`` shows for a chosen window).
What it is not: the simulator (``fate_lab.sim.speculative``), the runtime, or the draft's trainer
(``fate_lab.model.draft``).
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import pandas as pd
import torch
from tqdm.auto import tqdm

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.setups import Hardware
from fate_lab.model.trace import Trace
from fate_lab.offloading.runtime import Runtime, offload
from fate_lab.sim.speculative import (
    per_token_acceptance,
    pick_window,
    prompt_rows,
    simulate_speculative,
    union_sizes,
)

_COUNTERS = ("calls", "uses", "hits", "late", "misses", "bytes_moved", "stall_s", "prefetch_issued",
             "prefetch_wasted")


@dataclass
class ForwardRecord:
    """One forward of the target: KV length before it, tokens in it, time, and the runtime's counters during it."""

    past: int  # tokens in the KV cache when it began
    tokens: int  # T, tokens it processed
    t_start: float
    t_end: float
    counters: dict = field(default_factory=dict)  # deltas of _COUNTERS plus "moved" (landed transfers)
    timeline: tuple[int, int] = (0, 0)  # its events' index range in rt.stats.timeline

    @property
    def phase(self) -> str:
        """'prefill' when it started an empty cache, else 'decode'."""
        return "prefill" if self.past == 0 else "decode"


def _counters(rt: Runtime | None) -> dict:
    """The runtime's counters summed over layers and phases (empty without a runtime)."""
    if rt is None:
        return {}
    out = dict.fromkeys(_COUNTERS, 0)
    for phase in ("prefill", "decode"):
        s = rt.stats.total(phase)
        for k in _COUNTERS:
            out[k] += getattr(s, k)
    out["moved"] = sum(rt.stats.moved.values())
    return out


def _cache_length(args, kwargs) -> int:
    """Tokens already in the KV cache a forward was given (transformers 5 passes it as `cache`)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0


class ForwardLog:
    """Hooks on a model that record each forward (`ForwardRecord`); a context manager that removes them."""

    def __init__(self, model: torch.nn.Module, runtime: Runtime | None = None):
        self.model, self.runtime, self.records = model, runtime, []
        self._hooks = []

    def _pre(self, _module, args, kwargs) -> None:
        x = kwargs.get("input_ids", args[0] if args else None)
        if x is None:
            x = kwargs.get("inputs_embeds")
        tl = self.runtime.stats.timeline if self.runtime is not None else []
        self._open = ForwardRecord(_cache_length(args, kwargs), int(x.shape[1]), time.perf_counter(), 0.0,
                                   _counters(self.runtime), (len(tl), len(tl)))

    def _post(self, _module, _args, _out) -> None:
        r, self._open = self._open, None
        if r is None:
            return
        after = _counters(self.runtime)
        r.counters = {k: after[k] - r.counters[k] for k in after}
        tl = self.runtime.stats.timeline if self.runtime is not None else []
        r.timeline, r.t_end = (r.timeline[0], len(tl)), time.perf_counter()
        self.records.append(r)

    def __enter__(self) -> "ForwardLog":
        self._open = None
        self._hooks = [self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
                       self.model.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _AssistantCallWarning(logging.Filter):
    """Drops one transformers warning that is not about our call: its own candidate generator calls the draft's
    `generate` with a generation_config *and* generation kwargs (transformers 5.x), which it then warns about."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "together with generation-related" not in record.getMessage()


@contextmanager
def assistant_window(draft: torch.nn.Module, window: int):
    """Set the draft's generation_config to propose exactly `window` tokens per step; put it back after (and keep
    transformers' warning about its own internal draft call, `_AssistantCallWarning`, out of the output)."""
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1 (proposals per verify step), got {window!r}")
    gc = draft.generation_config
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    old = {k: getattr(gc, k, None) for k in keys}
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = window, "constant"
    gc.assistant_confidence_threshold = 0.0
    quiet = _AssistantCallWarning()
    logger = logging.getLogger("transformers.generation.utils")
    logger.addFilter(quiet)
    try:
        yield draft
    finally:
        logger.removeFilter(quiet)
        for k, v in old.items():
            setattr(gc, k, v)


def _as_ids(prompt) -> torch.Tensor:
    """A prompt as ids [1, P] (a list of ints or a tensor)."""
    ids = torch.as_tensor(prompt, dtype=torch.long)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"each prompt must be token ids [1, P] with P >= 1 (assisted generation runs one "
                         f"sequence at a time), got shape {tuple(ids.shape)}")
    return ids


def _pad_id(model) -> int | None:
    """The model's pad token, else its (first) end-of-text token: batch-1 greedy never pads, HF only asks."""
    gc = getattr(model, "generation_config", None)
    pad = getattr(gc, "pad_token_id", None)
    eos = getattr(gc, "eos_token_id", None) if pad is None else None
    return pad if pad is not None else (eos[0] if isinstance(eos, (list, tuple)) and eos else eos)


def generate_logged(model, ids: torch.Tensor, draft=None, window: int = 0, max_new_tokens: int = 32,
                    runtime: Runtime | None = None, **generate_kwargs) -> dict:
    """One greedy generate (assisted when window > 0) with its forwards logged: counts, `sequence`, `records`."""
    ids = _as_ids(ids).to(model.device)
    if window > 0 and draft is None:
        raise ValueError(f"window={window} needs a draft model (assistant_model); window 0 is plain decoding")
    kw = {"do_sample": False, "max_new_tokens": max_new_tokens, "pad_token_id": _pad_id(model), **generate_kwargs}
    with ForwardLog(model, runtime) as log:
        t0 = time.perf_counter()
        if window > 0:
            with assistant_window(draft, window):
                seq = model.generate(ids, assistant_model=draft, **kw)
        else:
            seq = model.generate(ids, **kw)
        t1 = time.perf_counter()
    return summarize_forwards(log.records, ids.shape[1], seq.shape[1], t1) | {
        "sequence": seq[0].tolist(), "wall_s": t1 - t0, "records": log.records}


def summarize_forwards(records: list[ForwardRecord], prompt_len: int, final_len: int, t_end: float) -> dict:
    """Counts of one generate from its logged forwards (see the module docstring for the arithmetic)."""
    if not records or records[0].phase != "prefill":
        raise ValueError("the first logged forward must start an empty KV cache (the prefill); log a whole generate")
    # sequence length when each forward began: P, then past + 1 (the last token is not in the cache yet)
    starts = [prompt_len] + [r.past + 1 for r in records[1:]] + [final_len]
    produced = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    proposed = [records[0].tokens - prompt_len] + [r.tokens - 1 for r in records[1:]]
    dec = [i for i, r in enumerate(records) if r.phase == "decode"]
    out = {"generated": final_len - prompt_len, "target_forwards": len(records), "verify_forwards": len(dec),
           "proposed": sum(proposed), "accepted": sum(produced) - len(records),
           "decode_tokens": sum(produced[i] for i in dec), "decode_s": t_end - records[0].t_end,
           "forward_s": sum(r.t_end - r.t_start for r in records[1:]),
           "prefill_s": records[0].t_end - records[0].t_start}
    for k in records[0].counters:
        out[k] = sum(records[i].counters[k] for i in dec)
    return out


def _aggregate(runs: list[dict], window: int, name: str) -> dict:
    """Sum per-prompt runs into one row with the derived rates."""
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    row = {"config": name, "window": window, **{k: sum(r[k] for r in runs) for k in keys}}
    n = row["decode_tokens"]
    row["acceptance"] = row["accepted"] / row["proposed"] if row["proposed"] else float("nan")
    row["tokens_per_forward"] = row["generated"] / row["target_forwards"]
    row["decode_tok_s"] = n / row["decode_s"] if row["decode_s"] > 0 else float("nan")
    if "moved" in row:
        row["moved_per_token"] = row["moved"] / n if n else float("nan")
        row["bytes_per_token"] = row["bytes_moved"] / n if n else float("nan")
        row["hit_rate"] = row["hits"] / row["uses"] if row["uses"] else float("nan")
        row["stall_ms_per_token"] = 1e3 * row["stall_s"] / n if n else float("nan")
    return row


def acceptance_run(model, draft, prompts_ids: list, window: int = 4, max_new_tokens: int = 32,
                   progress: bool = False, **generate_kwargs) -> dict:
    """Acceptance of `draft` against a (plain or offloaded) `model` on prompts: one aggregated row."""
    runs = [generate_logged(model, p, draft, window, max_new_tokens, **generate_kwargs)
            for p in tqdm(prompts_ids, desc=f"assisted w={window}", disable=not progress)]
    row = _aggregate(runs, window, "plain")
    row["sequences"] = [r["sequence"] for r in runs]
    return row


def speculative_decode(model, draft, prompts_ids: list, config: OffloadConfig, window: int, max_new_tokens: int = 32,
                       warmup: bool = True, progress: bool = False, **generate_kwargs) -> dict:
    """Offload `model` per `config`, greedy-generate each prompt (assisted by `draft` when window > 0); one row.

    The row: generated tokens, verify forwards, proposed/accepted and the acceptance rate, expert
    transfers (``moved``) and bytes per decode token, decode hit rate, stall per token, decode tokens/s,
    and the generated ``sequences``. With ``warmup`` a short generate of the first prompt runs first and
    its counters are dropped (the cache keeps what it loaded), as the other benchmarks do.
    """
    if not prompts_ids:
        raise ValueError("give at least one prompt (token ids [1, P])")
    with offload(model, config) as rt:
        if warmup:  # a length floor of the real runs would not fit these 4 tokens
            short = {k: v for k, v in generate_kwargs.items() if k not in ("min_new_tokens", "min_length")}
            generate_logged(model, prompts_ids[0], draft, window, 4, rt, **short)
            rt.reset_stats()
        runs = [generate_logged(model, p, draft, window, max_new_tokens, rt, **generate_kwargs)
                for p in tqdm(prompts_ids, desc=f"{config.name} w={window}", disable=not progress)]
    row = _aggregate(runs, window, config.name)
    row["sequences"] = [r["sequence"] for r in runs]
    return row


def compare_windows(model, draft, prompts_ids: list, config: OffloadConfig, windows=(1, 2, 3, 4),
                    max_new_tokens: int = 32, progress: bool = True, **generate_kwargs) -> pd.DataFrame:
    """Plain decoding (window 0) and assisted generation at each window, one row each, with ratios to window 0."""
    from fate_lab.study.clock import pinned

    with pinned():  # torch's threads held while measuring (study/clock.py)
        rows = [speculative_decode(model, draft, prompts_ids, config, w, max_new_tokens, progress=False,
                                   **generate_kwargs)
                for w in tqdm([0, *windows], desc="windows", disable=not progress)]
    df = pd.DataFrame([{k: v for k, v in r.items() if k != "sequences"} for r in rows])
    base = df.iloc[0]
    df["moved_ratio"] = df["moved_per_token"] / base["moved_per_token"]
    df["tok_s_ratio"] = df["decode_tok_s"] / base["decode_tok_s"]
    df.attrs["sequences"] = {r["window"]: r["sequences"] for r in rows}
    return df


@torch.no_grad()
def draft_matches(draft, trace: Trace) -> torch.Tensor:
    """Per trace row r: does the draft's greedy next token after rows ..r equal the trace's row r+1? bool [N].

    The last row of each prompt is False (the trace does not hold the token it produced). With
    these, ``sim.speculative.verify_steps`` reproduces greedy assisted generation's accept lengths.
    """
    device = next(draft.parameters()).device
    out = torch.zeros(trace.num_tokens, dtype=torch.bool)
    for first, _, rows in prompt_rows(trace):
        ids = trace.token_ids[first:first + rows]  # (S,)
        pred = draft(input_ids=ids[None].to(device)).logits[0].argmax(-1).cpu()  # (S,)
        out[first:first + rows - 1] = pred[:-1] == ids[1:]
    return out


def window_table(trace: Trace, config: OffloadConfig, hardware: Hardware, shape: ModelShape, window: int,
                 matches: torch.Tensor | None = None, acceptance: float | None = None,
                 draft_token_s: float = 0.0) -> pd.DataFrame:
    """Simulated plain decoding (window 0) and assisted generation at `window`: one row each, with ratios."""
    rows = []
    for w in sorted({0, window}):
        r = simulate_speculative(trace, config, hardware, shape, w, matches if w else None,
                                 acceptance if w else None, draft_token_s)
        rows.append(r.summary())
    df = pd.DataFrame(rows)
    df["moved_ratio"] = df["moved_per_token"] / df["moved_per_token"].iloc[0]
    df["tok_s_ratio"] = df["decode_tok_s"] / df["decode_tok_s"].iloc[0]
    return df


def roofline_table(trace: Trace, config: OffloadConfig, hardware: Hardware, shape: ModelShape,
                   acceptance_rate: float, measured_window: int, max_window: int = 8,
                   draft_token_s: float = 0.0) -> tuple[int, pd.DataFrame]:
    """(chosen window, roofline rows) from a measured acceptance rate at `measured_window` and plain decode's hit
    rate."""
    p = per_token_acceptance(acceptance_rate, measured_window)
    plain = simulate_speculative(trace, config, hardware, shape, 0)
    hit = plain.stats.summary()["decode"]["hit_rate"]
    best, rows = pick_window(union_sizes(trace, max_window + 1), shape, hardware, p, hit,
                             range(0, max_window + 1), draft_token_s)
    return best, pd.DataFrame(rows)


def measure_card_acceptance(out_dir, target_dir=None, prompts: int = 8, new_tokens: int = 48,
                            window: int = 4) -> dict:
    """Measure the saved draft's acceptance against the target and add it to the card."""
    import json
    from pathlib import Path

    from fate_lab.fit.draft import write_card
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.draft import load_draft
    from fate_lab.model.models import load_model

    target, tok = load_model(target_dir)  # None: the default embedded model, the draft's target
    draft, _ = load_draft(out_dir)
    ids = [tok(t, return_tensors="pt")["input_ids"] for t in heldout_prompts(prompts)]
    row = acceptance_run(target, draft, ids, window=window, max_new_tokens=new_tokens)
    acc = {"window": window, "prompts": prompts, "new_tokens": new_tokens, "acceptance": round(row["acceptance"], 4),
           "tokens_per_verify": round(row["tokens_per_forward"], 3)}
    card = json.loads((Path(out_dir) / "training.json").read_text())
    card["acceptance"] = acc
    write_card(Path(out_dir), card)
    return acc
