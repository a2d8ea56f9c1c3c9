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
from pathlib import Path

import pandas as pd

from fate_lab.paths import DATA_DIR, model_dir

CACHE_DIR = DATA_DIR.parent / "results" / "cache"

# Trace sizes: FAST is what the tests run; the full size gives ~1.5k decode + ~1.5k prefill tokens.
TRACE_SIZES = {True: {"prompts": 2, "decode_tokens": 12, "prompt_chars": 200},
               False: {"prompts": 16, "decode_tokens": 96, "prompt_chars": 400}}

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
    from fate_lab.model.trace import Trace
    from fate_lab.model.record import record_trace

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
        elif cfg.lossy == "substitute" and cfg.similarity is None and not (folder / SIMILARITY_FILE).is_file():
            skipped.append(f"{name} (no {SIMILARITY_FILE}: python -m fate_lab fit-similarity --model {folder})")
        else:
            keep.append(name)
    if skipped:
        print(f"left out for {folder.name}: " + "; ".join(skipped))
    return keep


class PaperTable(pd.DataFrame):
    """A DataFrame whose text and HTML displays keep every cell's full text.

    pandas cuts cells at ``display.max_colwidth`` (50 characters) in both reprs, which cuts the
    agreement sentences; this table lifts that limit for its own display only (the option is
    unchanged for every other table), and its text form is the whole table (``to_string``)
    rather than one that elides columns to fit a console. Anything derived from it is a plain
    DataFrame again.
    """

    def __repr__(self) -> str:
        # to_string neither cuts cells nor elides columns to fit a console's width
        return self.to_string()

    def _repr_html_(self) -> str | None:
        with pd.option_context("display.max_colwidth", None):
            return super()._repr_html_()

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        # the rows as data too, under a vendor type no front end renders (they show the HTML): the main
        # job reads them back from the executed notebooks to put the models' columns side by side
        return {TABLE_MIME: {"columns": [str(c) for c in self.columns], "rows": self.astype(str).values.tolist()}}


TABLE_MIME = "application/vnd.fate-lab.paper-table+json"


def paper_table(rows: list[tuple[str, str, str, str]]) -> PaperTable:
    """The closing table of a notebook: (quantity, paper's number, ours, agreement sentence), uncut."""
    return PaperTable(rows, columns=["quantity", "paper (Qwen1.5-MoE)", "ours", "agreement"])


def fmt_pct(x: float) -> str:
    """A fraction as a percentage with two decimals."""
    return f"{100 * x:.2f}%"


def fmt_bytes(n: float) -> str:
    """Bytes in a human unit (KiB, MiB, GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
