"""The project's public-domain text corpus (``data/corpus/corpus.jsonl.xz``).

What it is: loading of the committed corpus, with its whole-document train/held-out split.
What it is not: the builder; ``scripts/build_corpus.py`` makes the file from Debian packages.
"""
from __future__ import annotations

import json
import lzma
from pathlib import Path

from fate_lab.paths import DATA_DIR

CORPUS_FILE = DATA_DIR / "corpus" / "corpus.jsonl.xz"


def load_corpus(path: Path = CORPUS_FILE, split: str | None = None) -> list[dict]:
    """Documents as dicts ``{source, title, split, text}``; ``split`` filters to 'train' or 'val'."""
    if split not in (None, "train", "val"):
        raise ValueError(f"split must be None, 'train' or 'val', not {split!r}")
    if not Path(path).exists():
        raise FileNotFoundError(f"corpus not found at {path}; it ships in data/corpus (run from a full clone)")
    with lzma.open(path, "rt", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    return [d for d in docs if split is None or d["split"] == split]


def heldout_texts(path: Path = CORPUS_FILE) -> list[str]:
    """Texts of the held-out documents (never trained on)."""
    return [d["text"] for d in load_corpus(path, "val")]


def heldout_prompts(n: int = 8, max_chars: int = 400, path: Path = CORPUS_FILE) -> list[str]:
    """``n`` prompts cut from held-out documents (one per document, sources interleaved, deterministic)."""
    by_source: dict[str, list[str]] = {}
    for d in load_corpus(path, "val"):
        by_source.setdefault(d["source"], []).append(d["text"])
    prompts: list[str] = []
    i = 0
    while len(prompts) < n and any(i < len(v) for v in by_source.values()):
        for texts in by_source.values():
            if i < len(texts) and len(prompts) < n:
                cut = texts[i][:max_chars]
                prompts.append(cut[: cut.rfind(" ")] if " " in cut else cut)
        i += 1
    return prompts
