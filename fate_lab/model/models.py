"""Loading MoE language models for fate_lab: the embedded tiny MoE or a local HF checkpoint.

What it is: one call, ``load_model(name_or_path_or_None, device=..., dtype=...)``, that loads a model
and its tokenizer from a local directory (never from a hub) and checks that its model type is a causal-LM
MoE family whose transformers modeling uses the experts interface (`families.experts_interface_families`).
``None`` is the default embedded model; ``"tiny_moe"`` and ``"tiny_deepseek"`` name the embedded models
(``fate_lab.paths.EMBEDDED_MODELS``); anything else is a folder. What it is not: a downloader; safetensors only
(no pickled weights).

A model folder holds ``config.json``, ``*.safetensors`` weights and tokenizer files
(``tokenizer.json``, or ``tokenizer.model``, or ``vocab.json`` + ``merges.txt``, or ``vocab.txt``).
``load_model`` refuses, with a message saying what is wrong: a file instead of a folder, a folder
without weights, config or tokenizer files, a tokenizer that encodes text to no tokens, and
weights that load as NaN/inf (a corrupted file).
"""
from __future__ import annotations

from pathlib import Path

import torch

from fate_lab.model.folder import BadCheckpointFile, read_config
from fate_lab.paths import EMBEDDED_MODELS, model_dir

# tokenizer files transformers can build a tokenizer from; any one group suffices
_TOKENIZER_FILE_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",))
_PROBE_TEXT = "The quick brown fox jumps over the lazy dog."

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a dtype, a name ('bf16', 'float32', ...) or None (checkpoint's own)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


def _expected_tokenizer_files() -> str:
    """The accepted tokenizer file sets, for error messages."""
    return ", or ".join(" + ".join(group) for group in _TOKENIZER_FILE_SETS)


def _check_model_folder(path: Path) -> None:
    """FileNotFoundError/NotADirectoryError unless path is a folder with config, weights and tokenizer files."""
    if path.is_file():
        parent = path.parent
        hint = f", e.g. {parent}, the folder this file is in" if (parent / "config.json").is_file() else ""
        raise NotADirectoryError(f"{path} is a file, not a model folder; pass a model folder containing config.json "
                                 f"and the *.safetensors weights{hint}")
    if not path.is_dir():
        if path in EMBEDDED_MODELS.values():
            hint = f" (the embedded model {path.name!r} ships in data/{path.name} of a full clone)"
        else:
            hint = f" (the embedded models are named {', '.join(map(repr, EMBEDDED_MODELS))})"
        raise FileNotFoundError(f"model directory {path} does not exist{hint}; fate_lab never downloads models")
    if not list(path.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors weights in {path}; fate_lab loads safetensors only (no pickles)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}; a model folder holds config.json, *.safetensors "
                                f"weights and tokenizer files")
    if not any(all((path / name).is_file() for name in group) for group in _TOKENIZER_FILE_SETS):
        raise FileNotFoundError(f"no tokenizer files in {path}: expected {_expected_tokenizer_files()} "
                                f"(with tokenizer_config.json); copy them from the model the weights came from")


def _check_tokenizer(tokenizer, path: Path) -> None:
    """ValueError if the tokenizer encodes a plain English sentence to no tokens (an empty vocabulary)."""
    ids = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"the tokenizer in {path} encodes text to no tokens ({_PROBE_TEXT!r} -> [], "
                         f"vocabulary of {len(tokenizer)}); its tokenizer files are empty or broken: expected "
                         f"{_expected_tokenizer_files()} of the model the weights came from")


def _check_finite(model: torch.nn.Module, path: Path, dtype: torch.dtype | None) -> None:
    """ValueError naming the first parameter holding NaN/inf (one isfinite(...).all() per tensor)."""
    for name, p in model.named_parameters():
        finite = torch.isfinite(p)
        if bool(finite.all()):
            continue
        bad = ~finite
        first = tuple(int(i) for i in torch.unravel_index(bad.reshape(-1).int().argmax(), p.shape))
        hint = (f" (or the cast to {dtype} overflowed: try dtype=None or 'float32')"
                if dtype in (torch.float16, torch.bfloat16) else "")
        raise ValueError(f"{path}: parameter {name!r} of shape {tuple(p.shape)} holds {int(bad.sum())} non-finite "
                         f"values (NaN/inf) after loading, the first at index {first}; the weight file is "
                         f"corrupted{hint}. Re-export or re-copy the *.safetensors weights.")


def load_model(path: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | str | None = torch.float32, experts_implementation: str | None = None):
    """Load ``(model, tokenizer)`` from a local directory or an embedded model's name; ``None`` means the
    default embedded model (``tiny_moe``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fate_lab.model.checkpoint import ExpertIndex, checkpoint_files
    from fate_lab.model.families import experts_interface_families

    path = model_dir(path)
    _check_model_folder(path)
    config = read_config(path)
    families = experts_interface_families()
    if config.model_type not in families:
        raise ValueError(f"{path} is a {config.model_type!r} model; fate_lab loads causal-LM MoE families whose "
                         f"transformers modeling uses the experts interface: {', '.join(families)}")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)  # before the weights: fails fast
    _check_tokenizer(tokenizer, path)
    # use_kernels=False: transformers >= 5.25 otherwise swaps layers for kernels fetched from the Hugging Face Hub
    # (a download at run time, and math other than the modeling file's that the exactness contract is checked on)
    kwargs = {"local_files_only": True, "use_safetensors": True, "use_kernels": False}
    if (d := resolve_dtype(dtype)) is not None:
        kwargs["dtype"] = d
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    checkpoint_files(path)  # every weight file's header reads: a truncated or corrupt one is named
    try:  # mismatched sizes are reported below, naming the tensor, rather than as transformers' log table
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                           ignore_mismatched_sizes=True, **kwargs)
    except RuntimeError as e:
        raise BadCheckpointFile(f"{path}: transformers could not load these weights into a {config.model_type!r} "
                                f"model: {str(e).strip().splitlines()[-1]}") from None
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        ExpertIndex.build(model, path)  # a deleted expert tensor shows as a fused size mismatch: name it instead
        key, theirs, mine = mismatched[0]
        raise BadCheckpointFile(f"{path}: the checkpoint's {key} has shape {tuple(theirs)}, but the model that "
                                f"config.json describes needs {tuple(mine)} ({len(mismatched)} tensor(s) differ): "
                                "config.json and the weights are not the same model; copy config.json from the model "
                                "the weights came from")
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers would have initialised them at random: a model that is not the checkpoint
        raise ValueError(f"{path}: the checkpoint lacks {len(missing)} of the model's tensors (e.g. {missing[:3]}); "
                         "they would run randomly initialised. Re-export the checkpoint (save_pretrained) or copy "
                         "its missing *.safetensors shard")
    _check_finite(model, path, d)
    return model.to(device).eval(), tokenizer
