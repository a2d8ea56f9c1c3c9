"""Tables a class can read: short human column names with units, 3 significant digits, KiB/MiB, '—' for
nothing, the setting named once above the table, and never wider than the notebook (split into parts).

What it is: `readable(df, caption=...)` -> a `Table` (it displays as HTML or text; `.frame` keeps the numbers
for code), the column names a reader sees (`HUMAN`), and how a cell is written (`cell`). Every notebook table
goes through it.
What it is not: a place that computes a number.
"""
from __future__ import annotations

import html
import math
from collections.abc import Mapping

import pandas as pd

from fate_lab.study.verdict import sig

MAX_WIDTH_PX = 940  # a JupyterLab notebook's output area at 1400 px with the file browser open, minus margins
_PX_PER_CHAR, _PX_PER_COLUMN, _WRAP_CHARS = 8.0, 18.0, 28  # a text cell with spaces wraps at about 28 characters

# snake_case or terse names the analysis returns -> what a reader sees (with units)
HUMAN = {
    "cosine": "cosine, same token", "cosine_prefill": "cosine (prefill)", "cosine_decode": "cosine (decode)",
    "cosine_other_token": "cosine, other token (baseline)", "next_layer": "next layer",
    "normalized_entropy": "entropy / log E", "entropy": "entropy (nats)", "top1_prob": "top-1 probability",
    "topk_mass": "top-k mass", "load_imbalance": "busiest / mean load", "load_cv": "load CV", "tokens": "tokens",
    "mean_set_size": "set size (experts)", "set size": "set size (experts)",
    "hit_rate": "hit rate", "hit_rate_prefill": "prefill hit rate", "hit_rate_decode": "decode hit rate",
    "prefetch_loads": "prefetches", "prefetch_wasted": "prefetches wasted", "demand_loads": "loads on demand",
    "bits_per_weight": "bits per weight", "mean_abs": "mean |error|", "max_abs": "max |error|",
    "rel_fro": "relative error (Frobenius)", "group_size": "group size", "perplexity_fp": "perplexity (plain)",
    "perplexity_q": "perplexity (quantized)", "greedy_agreement": "greedy agreement", "mean_kl": "mean KL (nats)",
    "n_tokens": "tokens", "decode_agreement": "decode agreement", "decode_mean_kl": "decode mean KL (nats)",
    "n_decode": "decode steps", "bytes_per_expert": "bytes per expert", "dense_bytes": "dense bytes",
    "expert_bytes": "expert bytes", "expert_share": "experts' share of bytes", "moe_layers": "MoE layers",
    "experts_per_layer": "experts per layer", "top_k": "top-k", "active_expert_bytes_per_token":
    "active expert bytes per token", "dtype": "dtype",
    # fit.probes.compare_with_percentile
    "pct_recall": "recall (percentile 75)", "pct_precision": "precision (percentile 75)",
    "pct_set_size": "set size (percentile 75)", "probe_recall": "recall (probes)",
    "probe_precision": "precision (probes)", "probe_set_size": "set size (probes)",
    "eq_recall": "recall (probes, equal recall)", "eq_precision": "precision (probes, equal recall)",
    "eq_set_size": "set size (probes, equal recall)", "size_ratio": "set size ratio, probes / percentile",
    "probe_score_us": "probe scores (µs)", "gate_score_us": "router product (µs)",
    "probe_predict_us": "probe predict (µs)", "gate_predict_us": "router + percentile (µs)",
    # speculative tables
    "verify_forwards": "verify forwards", "moved_per_token": "experts moved per token",
    "moved_ratio": "experts moved vs plain", "decode_tok_s": "decode tok/s", "tok_s_ratio": "speed vs plain",
    "tokens_per_forward": "tokens per forward", "stall_ms_per_token": "stall (ms/token)",
}
_PERCENT_WORDS = ("hit rate", "recall", "precision", "agreement", "share", "accuracy", "greedy prefix", "acceptance")
_SIGNED_PERCENT_WORDS = ("perplexity change", "ppl change")
_BYTES_WORDS = ("bytes",)


def human(name) -> str:
    """A column name as a reader sees it."""
    return HUMAN.get(str(name), str(name).replace("_", " "))


def fmt_bytes(n: float) -> str:
    """Bytes in binary units with 3 significant digits (B, KiB, MiB, GiB, TiB)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{sig(n)} {unit}"
        n /= 1024
    return f"{sig(n)} TiB"


def column_kind(name: str) -> str:
    """How a column's numbers are written, from its (human) name: 'percent', 'signed percent', 'bytes', 'number'."""
    low = str(name).lower()
    if any(w in low for w in _SIGNED_PERCENT_WORDS):
        return "signed percent"
    if "(%)" in low or "%" in low.split("(")[-1]:
        return "number"  # already in percent
    if any(w in low for w in _PERCENT_WORDS) and not any(w in low for w in ("per token", "tok/s", "size", "(µs)")):
        return "percent"
    if any(w in low for w in _BYTES_WORDS) and "mib" not in low and "gib" not in low:
        return "bytes"
    return "number"


def cell(value, kind: str = "number") -> str:
    """One cell as a reader sees it: '—' for nothing (NaN, None), 3 significant digits, units by column kind."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return " ".join(cell(v) for v in value) if len(value) <= 16 else f"{len(value)} values"
    if isinstance(value, str):
        return value
    try:
        x = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(x):
        return "—"
    if kind == "percent":
        return f"{sig(100 * x)}%"
    if kind == "signed percent":
        return ("+" if x > 0 else "") + f"{sig(100 * x)}%"
    if kind == "bytes":
        return fmt_bytes(x)
    if float(x).is_integer() and abs(x) < 1e15 and not isinstance(value, float):
        return f"{int(x):,}"
    return sig(x)


def _width_px(col: pd.Series, header: str) -> float:
    def chars(s: str) -> int:
        return min(len(s), _WRAP_CHARS) if " " in s else len(s)

    longest_word = max((len(w) for w in str(header).split()), default=1)
    return _PX_PER_COLUMN + _PX_PER_CHAR * max([longest_word] + [chars(str(v)) for v in col])


def split_columns(frame: pd.DataFrame, max_px: float = MAX_WIDTH_PX, index: bool = True) -> list[pd.DataFrame]:
    """`frame`'s columns in consecutive parts, each no wider than max_px (the index repeated in each part)."""
    idx_px = 0.0
    if index:
        idx = pd.Series([str(i) for i in frame.index])
        idx_px = _width_px(idx, " ".join(str(n) for n in frame.index.names if n is not None) or "")
    parts, cur, width = [], [], idx_px
    for c in frame.columns:
        w = _width_px(frame[c], str(c))
        if cur and width + w > max_px:
            parts.append(frame[cur])
            cur, width = [], idx_px
        cur.append(c)
        width += w
    if cur or not parts:
        parts.append(frame[cur])
    return parts


class Table:
    """A table as a reader sees it: a caption, then one or more parts (columns split to fit the notebook).

    ``frame`` is the table of numbers it was made from (for code and tests); ``parts`` are the text tables shown.
    """

    def __init__(self, frame: pd.DataFrame, parts: list[pd.DataFrame], caption: str = "", index: bool = True):
        self.frame, self.parts, self.caption, self.index = frame, parts, caption, index

    @property
    def text(self) -> pd.DataFrame:
        """All the shown cells in one DataFrame of strings."""
        return pd.concat(self.parts, axis=1) if len(self.parts) > 1 else self.parts[0]

    def _repr_html_(self) -> str:
        cap = f'<p class="fate-lab-caption">{html.escape(self.caption)}</p>' if self.caption else ""
        return cap + "".join(p.to_html(index=self.index, border=0, escape=True) for p in self.parts)

    def __repr__(self) -> str:
        body = "\n\n".join(p.to_string(index=self.index) for p in self.parts)
        return f"{self.caption}\n{body}" if self.caption else body


def readable(df: pd.DataFrame, caption: str = "", rename: Mapping[str, str] | None = None,
             kinds: Mapping[str, str] | None = None, index: bool | None = None, max_px: float = MAX_WIDTH_PX) -> Table:
    """`df` as a reader sees it (module docstring). `rename`: extra column names; `kinds`: a column's kind
    (`column_kind`'s words) where its name does not tell; `index` None shows the index unless it is 0, 1, 2..."""
    frame = df.copy()
    names = {c: (rename or {}).get(c, human(c)) for c in frame.columns}
    frame = frame.rename(columns=names)
    frame.index = frame.index.set_names([human(n) if n is not None else None for n in frame.index.names])
    kinds = {names.get(k, k): v for k, v in (kinds or {}).items()}
    text = pd.DataFrame({c: [cell(v, kinds.get(c) or column_kind(c)) for v in frame[c]] for c in frame.columns},
                        index=frame.index)
    if isinstance(text.index, pd.MultiIndex):
        names = [n for n in text.index.names if n is not None]
        text.index = pd.Index([" · ".join(cell(x) for x in i) for i in text.index], name=" · ".join(names) or None)
    elif text.index.dtype == object:
        text.index = pd.Index([cell(i) for i in text.index], name=text.index.name)
    if index is None:
        index = any(n is not None for n in df.index.names) or not (
            isinstance(df.index, pd.RangeIndex) and df.index.start == 0 and df.index.step == 1)
    return Table(frame, split_columns(text, max_px, index), caption, index)


__all__ = ["HUMAN", "MAX_WIDTH_PX", "Table", "cell", "column_kind", "fmt_bytes", "human", "readable", "split_columns"]
