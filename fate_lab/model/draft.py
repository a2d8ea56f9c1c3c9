"""The dense draft model that ships in ``data/tiny_draft`` (speculative decoding): where it is and how it loads.

What this file is: ``load_draft()``, ``(model, tokenizer)`` from ``data/tiny_draft`` (or another folder),
offline, safetensors only. What it is not: its trainer (``fate_lab/fit/draft.py``,
``python -m fate_lab train-draft``) or the speculative decoding (``fate_lab.study.speculative``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from fate_lab.paths import DATA_DIR

TINY_DRAFT_DIR = DATA_DIR / "tiny_draft"


def load_draft(path: str | Path | None = None, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` of the draft in ``path`` (default ``data/tiny_draft``), offline, safetensors only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else TINY_DRAFT_DIR
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (path / f).exists()]
    if missing:
        raise FileNotFoundError(f"no draft model at {path} (missing {', '.join(missing)}); train one with "
                                f"`python -m fate_lab train-draft --minutes 12` (or pass the folder of another draft)")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True, dtype=dtype,
                                                 use_kernels=False)  # no Hub kernels: offline, plain math
    return model.eval(), tokenizer
