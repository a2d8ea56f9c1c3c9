"""Where fate_lab finds its shipped data (``data/`` at the repository root, or $FATE_LAB_DATA).

The embedded models are picked by name (``load_model("tiny_deepseek")``, a notebook's ``MODEL``):
``EMBEDDED_MODELS`` maps each name to its folder; ``DEFAULT_MODEL`` is the one used when none is named.
"""
from __future__ import annotations

import os
from pathlib import Path

DATA_DIR = Path(os.environ.get("FATE_LAB_DATA", Path(__file__).resolve().parent.parent / "data"))
TINY_MOE_DIR = DATA_DIR / "tiny_moe"
TINY_DEEPSEEK_DIR = DATA_DIR / "tiny_deepseek"

# name -> folder; the first is the default. Each has a MODEL_CARD.md (shape, training, held-out ppl, load).
EMBEDDED_MODELS: dict[str, Path] = {"tiny_moe": TINY_MOE_DIR, "tiny_deepseek": TINY_DEEPSEEK_DIR}
DEFAULT_MODEL = "tiny_moe"


def model_dir(model: str | Path | None) -> Path:
    """The folder a model argument names: None or '' -> the default embedded model, an embedded model's
    name (``"tiny_moe"``, ``"tiny_deepseek"``) -> its folder under data/, anything else -> that path.

    A name always means the embedded model; write ``./tiny_moe`` for a local folder of the same name.
    """
    if model is None or (isinstance(model, str) and not model.strip()):
        return EMBEDDED_MODELS[DEFAULT_MODEL]
    if isinstance(model, str) and model in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[model]
    return Path(model)


def model_name(model: str | Path | None) -> str:
    """A short label for tables: the embedded name, or the folder's name."""
    path = model_dir(model)
    for name, folder in EMBEDDED_MODELS.items():
        if path == folder:
            return name
    return path.name
