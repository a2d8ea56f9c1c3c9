"""Loading MoE language models for fate_lab: the embedded tiny MoE or a local HF checkpoint.

What it is: one call, ``load_model(path_or_None, device=..., dtype=...)``, that loads a model and
its tokenizer from a local directory (never from a hub) and checks that fate_lab supports its
MoE family. What it is not: a downloader; safetensors only (no pickled weights).
"""
from __future__ import annotations

from pathlib import Path

import torch

from fate_lab.paths import TINY_MOE_DIR

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a dtype, a name ('bf16', 'float32', ...) or None (checkpoint's own)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


def load_model(path: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = torch.float32, experts_implementation: str | None = None):
    """Load ``(model, tokenizer)`` from a local directory; ``None`` means the embedded tiny MoE."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from fate_lab.adapters import SUPPORTED_FAMILIES

    path = Path(path) if path is not None else TINY_MOE_DIR
    if not path.is_dir():
        hint = " (the embedded model ships in data/tiny_moe of a full clone)" if path == TINY_MOE_DIR else ""
        raise FileNotFoundError(f"model directory {path} does not exist{hint}; fate_lab never downloads models")
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors weights in {path}; fate_lab loads safetensors only (no pickles)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type not in SUPPORTED_FAMILIES:
        raise ValueError(f"{path} is a {config.model_type!r} model; fate_lab supports the MoE families "
                         f"{', '.join(SUPPORTED_FAMILIES)}")
    kwargs = {"local_files_only": True, "use_safetensors": True}
    if (d := resolve_dtype(dtype)) is not None:
        kwargs["dtype"] = d
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer
