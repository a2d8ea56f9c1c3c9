"""Notebook conveniences: load the model a notebook names, get (and cache) its trace, build tables.

What it is: the few calls every numbered notebook starts with, so notebooks stay thin:
``FAST = lab.fast_mode(FAST)``, ``lab.load(MODEL)``, ``lab.get_trace(MODEL, fast=FAST)``,
``lab.paper_table(rows)``.
What it is not: analysis (``analysis``, ``predictors``, ``replay``) or plotting (``plots``).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from fate_lab.paths import DATA_DIR, model_dir

CACHE_DIR = DATA_DIR.parent / "results" / "cache"

@dataclass(frozen=True)
class Sizes:
    """How much every notebook measures in one mode: FAST (what the tests run) or full size (the main job).

    One table for all notebooks, so that a number read in two notebooks comes from the same trace.
    """

    prompts: int  # held-out prompts of THE trace (lab.get_trace)
    decode_tokens: int  # greedy decode steps per prompt of the trace
    prompt_chars: int  # characters per prompt (cut at a word boundary)
    new_tokens: int  # decode length of a timed run (05, 06, 07)
    repeats: int  # timed runs per config, for the spread of every speed (05, 06)
    eval_tokens: int  # held-out tokens for perplexity, agreement and KL (06)
    decode_eval_tokens: int  # of those, fed token by token through the runtime (06's decode mix)
    runtime_prompts: int  # prompts per runtime row (07)
    lossy_tokens: int  # held-out tokens decoded one by one per lossy run (08)
    lossy_prompts: int  # prompts of 08's decode comparison
    lossy_decode: int  # decode steps per such prompt
    grid_steps: int  # budgets of a cache grid or sweep (04, 09)
    paired_rounds: int  # interleaved plain / all-resident rounds of 05's "never slower" row (bench.paired_ratio)


SIZES = {True: Sizes(prompts=2, decode_tokens=12, prompt_chars=200, new_tokens=8, repeats=2, eval_tokens=1024,
                     decode_eval_tokens=128, runtime_prompts=1, lossy_tokens=32, lossy_prompts=1, lossy_decode=4,
                     grid_steps=3, paired_rounds=4),
         False: Sizes(prompts=16, decode_tokens=96, prompt_chars=400, new_tokens=48, repeats=3, eval_tokens=8192,
                      decode_eval_tokens=1024, runtime_prompts=2, lossy_tokens=128, lossy_prompts=2, lossy_decode=16,
                      grid_steps=10, paired_rounds=10)}
# The trace of each mode (~1.5k decode + ~1.5k prefill tokens at full size)
TRACE_SIZES = {fast: {"prompts": s.prompts, "decode_tokens": s.decode_tokens, "prompt_chars": s.prompt_chars}
               for fast, s in SIZES.items()}


def sizes(fast: bool) -> Sizes:
    """The sizes of a mode (`FAST = lab.fast_mode(FAST)` first, so that FATE_LAB_FAST is honoured)."""
    return SIZES[bool(fast)]


_loaded: dict = {}

# FATE_LAB_FAST=1 (or true/yes/on) forces FAST mode whatever a notebook's FAST parameter says.
FAST_ENV = "FATE_LAB_FAST"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def fast_mode(FAST: bool) -> bool:
    """The FAST flag a notebook runs with: its parameter, or True when ``FATE_LAB_FAST`` says so.

    The environment can only switch FAST mode on (``FATE_LAB_FAST=0`` or unset leaves the
    parameter as it is); a value that is neither true nor false is refused rather than guessed.
    """
    raw = os.environ.get(FAST_ENV, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw not in _FALSE:
        raise ValueError(f"{FAST_ENV}={os.environ[FAST_ENV]!r}: use 1 (fast) or 0 (as the FAST parameter says)")
    return bool(FAST)


def model_path(model: str | Path | None) -> Path:
    """The model folder a notebook's ``MODEL`` parameter names: '' or None -> the default embedded model,
    ``"tiny_moe"`` / ``"tiny_deepseek"`` -> that embedded model, anything else -> a local checkpoint folder."""
    return model_dir(model)


def load(model: str | Path | None = None, dtype: str = "float32"):
    """``(model, tokenizer)`` for a notebook, loaded once per kernel."""
    from fate_lab.model.models import load_model

    key = (str(model_path(model)), dtype)
    if key not in _loaded:
        _loaded[key] = load_model(model_path(model), dtype=dtype)
    return _loaded[key]


def _cache_key(path: Path, size: dict) -> str:
    cfg = path / "config.json"
    stamp = [str(path.resolve()), json.dumps(size, sort_keys=True)]
    # the weights only: side files kept with the model (probes, similarity tables) must not invalidate traces
    for f in sorted(path.glob("model*.safetensors")) + [cfg]:
        if f.exists():
            stamp.append(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}")
    return hashlib.sha1("|".join(stamp).encode()).hexdigest()[:16]


def get_trace(model: str | Path | None = None, fast: bool = False, cache: bool = True, split: str = "eval"):
    """A routing trace of held-out prompts (prefill + greedy decode), cached under results/cache.

    ``split="eval"`` uses the first held-out prompts; ``split="calib"`` the next, disjoint ones
    (for anything that is tuned on a trace, such as the miss-curve allocation).
    """
    from fate_lab.model.corpus import heldout_prompts
    from fate_lab.model.record import record_trace
    from fate_lab.model.trace import Trace

    if split not in ("eval", "calib"):
        raise ValueError(f"split must be 'eval' or 'calib', not {split!r}")
    size = dict(TRACE_SIZES[bool(fast)], split=split)
    path = model_path(model)
    file = CACHE_DIR / f"trace-{_cache_key(path, size)}.safetensors"
    if cache and file.exists():
        return Trace.load(file)
    m, tok = load(model)
    n = size["prompts"]
    prompts = heldout_prompts(2 * n, max_chars=size["prompt_chars"])
    prompts = prompts[:n] if split == "eval" else prompts[n:]
    if not prompts:
        raise ValueError("the held-out corpus has too few documents for a calibration trace")
    trace = record_trace(m, tok, prompts, decode_tokens=size["decode_tokens"])
    if cache:
        trace.save(file)
    return trace


def presets_for(model: str | Path | None, names) -> list[str]:
    """The presets of ``names`` the model can run. A preset that needs a file the model's folder lacks
    (``fate_learned``: the learned probes; ``substitute``: the expert similarity table) is left out,
    and named with the command that makes the file: nothing is swapped for something else silently."""
    from fate_lab.core.config import OffloadConfig
    from fate_lab.policy.probes import PROBES_FILE
    from fate_lab.policy.similarity import SIMILARITY_FILE

    folder = model_path(model)
    keep, skipped = [], []
    for name in names:
        cfg = OffloadConfig.preset(name)
        if cfg.predictor == "learned_gate" and cfg.probes is None and not (folder / PROBES_FILE).is_file():
            skipped.append(f"{name} (no {PROBES_FILE}: python -m fate_lab fit-probes --model {folder})")
        elif cfg.lossy.kind == "substitute" and cfg.similarity is None and not (folder / SIMILARITY_FILE).is_file():
            skipped.append(f"{name} (no {SIMILARITY_FILE}: python -m fate_lab fit-similarity --model {folder})")
        else:
            keep.append(name)
    if skipped:
        print(f"left out for {folder.name}: " + "; ".join(skipped))
    return keep


TABLE_MIME = "application/vnd.fate-lab.paper-table+json"
PAPER_COLUMNS = ["quantity", "paper (Qwen1.5-MoE) or target", "ours", "verdict", "why"]


class PaperTable(pd.DataFrame):
    """The closing table of a notebook: one row per `verdict.Claim`, every cell's full text.

    pandas cuts cells at ``display.max_colwidth`` (50 characters) in both reprs, which cuts the reasons; this
    table lifts that limit for its own display only, and its text form is the whole table (``to_string``).
    Beside the HTML it carries its claims as data under `TABLE_MIME` (a vendor type no front end renders):
    the main job reads them back from the executed notebooks. Anything derived from it is a plain DataFrame.
    """

    _metadata = ["claims", "meta"]

    def __repr__(self) -> str:
        return self.to_string()

    def _repr_html_(self) -> str | None:
        with pd.option_context("display.max_colwidth", None):
            return super()._repr_html_()

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return {TABLE_MIME: {"columns": [str(c) for c in self.columns], "rows": self.astype(str).values.tolist(),
                             "claims": [c.as_dict() for c in (self.claims or [])], "meta": dict(self.meta or {})}}


def paper_table(claims: list, fast: bool | None = None, drift=None) -> PaperTable:
    """The closing table of a notebook from its claims (`fate_lab.study.verdict`); the verdict column is each
    claim's computed verdict. ``drift`` (a `clock.Drift`, for notebooks that time things) adds the machine's
    speed check as a last row; when the machine drifted, the ``clocked`` claims (`verdict.drifted`) are not
    comparable. The mode and the clock travel with the claims to the main job."""
    from fate_lab.study.verdict import Claim, drifted

    bad = [c for c in claims if not isinstance(c, Claim)]
    if bad:
        raise TypeError(f"paper_table takes verdict.Claim rows (verdict.close, beats, holds, not_comparable), got "
                        f"{type(bad[0]).__name__}")
    claims = list(claims)
    if drift is not None:  # a drifted machine leaves the rows judged against its calibration undecided
        claims = (drifted(claims, drift.change) if drift.drifted else claims) + [drift.claim()]
    t = PaperTable([(c.quantity, c.reference, c.ours, c.verdict, c.why) for c in claims], columns=PAPER_COLUMNS)
    t.claims = claims
    t.meta = {"fast": fast, **({} if drift is None else {"clock": drift.describe(), "drifted": drift.drifted})}
    return t


def fmt_pct(x: float) -> str:
    """A fraction as a percentage with 3 significant digits ('—' for NaN)."""
    from fate_lab.study.verdict import fmt

    return fmt(x, "%")


def fmt_bytes(n: float) -> str:
    """Bytes in a human unit (KiB, MiB, GiB), 3 significant digits."""
    from fate_lab.study.show import fmt_bytes as f

    return f(n)
