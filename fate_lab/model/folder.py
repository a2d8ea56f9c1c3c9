"""A local checkpoint folder's files, read with errors that name the file, the value and what to do.

What this file is: `read_config(folder)` (config.json checked as JSON, as an object with a known `model_type`
and a torch `dtype`, then parsed by transformers' `AutoConfig`), `safetensors_keys(file)` (one safetensors
header read; a truncated or corrupt file is named with safetensors' own reason) and `weight_files(folder)`
(the shards `model.safetensors.index.json` lists, each on disk, else every `*.safetensors`). Every loader of
fate_lab opens a folder through these, so a broken file is reported the same way whichever call found it.

What it is not: no tensor is read here (`checkpoint.py` reads experts and dense tensors), nothing downloads,
and nothing is repaired: a broken file is refused, with what to re-copy or re-export.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

_REEXPORT = "re-copy it, or re-export the model with save_pretrained"


class BadCheckpointFile(ValueError):
    """A checkpoint folder holds a file fate_lab cannot read; the message names the file and what to do."""


def _json(path: Path, what: str):
    """path parsed as JSON; BadCheckpointFile naming the file, the position and what it should hold."""
    text = path.read_text(errors="replace")
    if not text.strip():
        raise BadCheckpointFile(f"{path} is empty; {what} must be a JSON object: {_REEXPORT}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadCheckpointFile(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); {what} "
                              f"must be a JSON object: {_REEXPORT}") from None


def _bad_dtypes(entry, where: str = "") -> list[tuple[str, object]]:
    """(key path, value) of every `dtype`/`torch_dtype` entry that does not name a torch dtype."""
    out = []
    if isinstance(entry, dict):
        for key, value in entry.items():
            here = f"{where}.{key}" if where else key
            if key in ("dtype", "torch_dtype") and value is not None and not (
                    isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)):
                out.append((here, value))
            elif isinstance(value, dict):
                out += _bad_dtypes(value, here)
    return out


def read_config(path: str | Path):
    """The PretrainedConfig of a checkpoint folder (or of a config.json file), checked before transformers parses
    it; FileNotFoundError / BadCheckpointFile (a ValueError) naming config.json, the field and what is allowed."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        what = f"{path} holds no config.json" if path.is_dir() else f"{path} does not exist"
        raise FileNotFoundError(f"{what}; give a checkpoint folder (config.json and its *.safetensors weights, as "
                                "save_pretrained writes them) or its config.json file")
    raw = _json(file, "config.json")
    if not isinstance(raw, dict):
        raise BadCheckpointFile(f"{file} holds a JSON {type(raw).__name__}, not an object; config.json must be a JSON "
                              "object such as {\"model_type\": \"mixtral\", \"hidden_size\": 4096, ...}")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise BadCheckpointFile(f"{file} has no \"model_type\" (got {model_type!r}); it names the model family, e.g. "
                              "\"mixtral\" or \"qwen3_moe\": copy config.json from the model the weights came from")
    if model_type not in CONFIG_MAPPING_NAMES:
        import transformers

        raise BadCheckpointFile(f"{file}: \"model_type\": {model_type!r} is not a model type of the installed "
                              f"transformers {transformers.__version__}; a newer transformers may know it "
                              "(fate_lab serves the experts-interface families of the installed one)")
    bad = _bad_dtypes(raw)
    if bad:
        key, value = bad[0]
        raise BadCheckpointFile(f"{file}: \"{key}\": {value!r} is not a torch dtype; use one of \"float32\", "
                              "\"bfloat16\", \"float16\" (the dtype the weights were saved in), or remove the entry")
    try:
        return AutoConfig.from_pretrained(file.parent if file.name == "config.json" else file,
                                          local_files_only=True)
    except (ValueError, TypeError, KeyError, AttributeError, StrictDataclassError) as e:  # a field's type or value
        msg = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise BadCheckpointFile(f"{file} is not a valid {model_type!r} config: {msg}") from None


def safetensors_keys(file: str | Path) -> list[str]:
    """The tensor names in one safetensors file's header; BadCheckpointFile naming the file when it cannot be read."""
    from safetensors import SafetensorError, safe_open

    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist; {_REEXPORT}")
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise BadCheckpointFile(f"{file} is not a readable safetensors file ({reason}): truncated or corrupt; "
                              f"{_REEXPORT}") from None


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index lists (each must exist), else every
    `*.safetensors` of the folder (a single file is returned as is)."""
    folder = Path(folder)
    if folder.is_file():
        return [folder]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        raw = _json(index, "the shard index")
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise BadCheckpointFile(f"{index} has no \"weight_map\" object of tensor name -> shard file; {_REEXPORT}")
        paths = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [p.name for p in paths if not p.is_file()]
        if absent:
            raise BadCheckpointFile(f"{index} lists shards that are not in {folder}: {absent[:3]}"
                                  f"{f' (and {len(absent) - 3} more)' if len(absent) > 3 else ''}; copy the missing "
                                  "*.safetensors files")
        return paths
    paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors file in {folder}; fate_lab reads safetensors checkpoints only "
                                "(save the model with save_pretrained)")
    return paths
