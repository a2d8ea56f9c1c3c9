"""What the sizing tool knows of a model: its shape and weights by class from its config alone, and byte sizes.

What it is: `model_spec(model)` -> `ModelSpec` (an embedded model's name, a published config of `data/configs`,
a checkpoint folder or a config.json; the config checked field by field, built on the meta device once and
remembered: the simulator's `ModelShape`, the weights by tensor class and layer, and the weight format the
config declares), `model_names()`, and `parse_bytes` (a size with its unit).
What it is not: the sizing (`study/plan.py` for the runtime presets, `study/fit.py` for llama.cpp-style
placements).
"""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from fate_lab.core.shape import ModelShape
from fate_lab.hardware.formats import DECLARED
from fate_lab.hardware.params import ModelParams
from fate_lab.paths import DATA_DIR, EMBEDDED_MODELS

CONFIGS_DIR = DATA_DIR / "configs"  # published configs, each with its source.md
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MIN_BUDGET = 2**20  # a budget below 1 MiB holds no expert of any model: a unit was surely meant
# config.json fields that size the model: each must be an int > 0 where present
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size", "num_experts",
               "num_local_experts", "n_routed_experts", "num_experts_per_tok", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "head_dim")


def parse_bytes(text: str | int, flag: str = "--budget") -> int:
    """'12GiB', '16 GB', '500MiB' -> bytes (binary KiB/MiB/GiB, decimal KB/MB/GB); an int is bytes. A number
    without its unit, a size below 1 MiB or one too large to count is refused in one line naming `flag`."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if m is None or m.group(2).lower() not in _UNITS:
            unit = "" if m is None else m.group(2)
            what = "has no unit" if m is not None and not unit else "is not a size"
            raise ValueError(f"{flag} {str(text)[:40]!r} {what}: give a number with a unit, e.g. 12GiB, 16GB, 500MiB "
                             f"(units: {', '.join(_UNITS)})")
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value) or value >= 2**60:
        raise ValueError(f"{flag} {str(text)[:40]!r}: too large to be a memory size; give e.g. 24GiB")
    if value < MIN_BUDGET:
        raise ValueError(f"{flag} {str(text)[:40]!r} is {value:.0f} bytes, below 1 MiB: give a unit, e.g. 12GiB")
    return int(value)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the sizing tool knows it: its shape at the precision that runs, its weights by class."""

    name: str
    shape: ModelShape
    vocab_size: int
    tied: bool
    source: str  # where the config came from
    params: ModelParams | None = None
    declared: str | None = None  # the weight format its config declares (quantization_config), if any


def model_names() -> list[str]:
    """Every model `plan` knows by name: the embedded models, then the published configs of `data/configs` whose
    model type this transformers has (a config of a family it lacks, e.g. DeepSeek-MoE's `deepseek`, is left
    out: it could not be built)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    published = [d.name for d in CONFIGS_DIR.iterdir() if (d / "config.json").is_file()
                 and json.loads((d / "config.json").read_text()).get("model_type") in CONFIG_MAPPING]
    return list(EMBEDDED_MODELS) + sorted(published)


def _config_path(model: str) -> Path:
    if model in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[model] / "config.json"
    if (CONFIGS_DIR / model / "config.json").is_file():
        return CONFIGS_DIR / model / "config.json"
    p = Path(model)
    path = p / "config.json" if p.is_dir() else p
    if not path.is_file():
        known = sorted(EMBEDDED_MODELS) + sorted(d.name for d in CONFIGS_DIR.iterdir() if d.is_dir())
        raise ValueError(f"--model {model!r}: not an embedded or published model ({', '.join(known)}), nor a "
                         "checkpoint folder with config.json, nor a config.json file")
    return path


def read_config(path: Path) -> dict:
    """A config.json as a dict, every sizing field checked (one clear line naming the file and the field); whether
    the installed transformers has its family is checked when it is built (`_build`)."""
    text = path.read_text(errors="replace")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        what = "is empty" if not text.strip() else f"is not JSON ({exc.msg} at line {exc.lineno})"
        raise ValueError(f"--model: {path} {what}; give a model's config.json") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--model: {path} holds a JSON {type(raw).__name__}, not an object of config fields")
    mt = raw.get("model_type")
    if mt is None:
        raise ValueError(f"--model: {path} has no 'model_type' field; a transformers config.json names its family")
    for key in SIZE_FIELDS:
        v = raw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ValueError(f"--model: {path}: config field {key}={v!r}; give a whole number > 0")
    return raw


@functools.lru_cache(maxsize=32)
def _build(path: str, dtype: torch.dtype) -> tuple:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from fate_lab.core.costs import model_params
    from fate_lab.model.adapters import adapt

    raw = read_config(Path(path))
    if raw["model_type"] not in CONFIG_MAPPING:
        raise ValueError(f"--model: {path}: model_type {raw['model_type']!r} is not a family of the installed "
                         "transformers")
    declared = (raw.get("quantization_config") or {}).get("quant_method")
    if declared is not None and declared not in DECLARED:
        raise ValueError(f"--model: {path} declares quantization {declared!r}, which the sizing tool has no "
                         "format for; give --weights FORMAT")
    kw = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "quantization_config",
                                                     "model_type")}
    try:
        cfg = AutoConfig.for_model(raw["model_type"], **kw)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        a = adapt(model)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise ValueError(f"--model: {path}: transformers could not build a {raw['model_type']} model from this "
                         f"config: {str(exc).splitlines()[0][:200]}") from None
    kv = int(a.kv_bytes_per_token(dtype))
    scale = dtype.itemsize / next(model.parameters()).element_size()
    shape = ModelShape(len(getattr(model, "model", model).layers), a.num_moe_layers, a.num_experts, a.top_k,
                       a.hidden_size, a.expert_intermediate_size, dtype, int(a.dense_bytes() * scale), kv)
    params = model_params(model, Path(path).parent.name, a.top_k, kv)
    return shape, params, int(getattr(cfg, "vocab_size", 0) or 0), bool(getattr(cfg, "tie_word_embeddings", False)), \
        DECLARED.get(declared)


CACHE_VERSION = 1  # bump when what _build returns changes: older cache entries are then ignored


def cache_dir() -> Path:
    """Where built configs are remembered between runs: $FATE_LAB_CACHE, else ~/.cache/fate_lab/configs."""
    import os

    return Path(os.environ.get("FATE_LAB_CACHE") or Path.home() / ".cache" / "fate_lab" / "configs")


def _cache_file(path: Path, dtype: torch.dtype) -> Path:
    import hashlib
    from importlib.metadata import version

    key = hashlib.sha256(path.read_bytes() + f"|{dtype}|{version('transformers')}|{CACHE_VERSION}".encode())
    return cache_dir() / f"{key.hexdigest()[:32]}.json"


def _to_json(built: tuple) -> str:
    import dataclasses

    shape, params, vocab, tied, declared = built
    return json.dumps({"shape": {**dataclasses.asdict(shape), "dtype": str(shape.dtype).replace("torch.", "")},
                       "params": dataclasses.asdict(params), "vocab": vocab, "tied": tied, "declared": declared})


def _from_json(text: str) -> tuple:
    from fate_lab.hardware.params import LayerParams

    d = json.loads(text)
    sh = {**d["shape"], "dtype": getattr(torch, d["shape"]["dtype"])}
    p = d["params"]
    layers = tuple(LayerParams(tuple((c, n) for c, n in lay.pop("dense")), **lay) for lay in p.pop("layers"))
    return ModelShape(**sh), ModelParams(layers=layers, **p), d["vocab"], d["tied"], d["declared"]


def model_spec(model: str, dtype: torch.dtype = torch.bfloat16) -> ModelSpec:
    """An embedded model's name, a published model's name (`data/configs`), a checkpoint folder or a config.json,
    built on the meta device at `dtype`; remembered per file in this process and, keyed by the config's bytes and
    the transformers version, in `cache_dir()` (a build imports transformers' modeling code: seconds)."""
    path = _config_path(str(model))
    read_config(path)  # every field checked on every call, cached or not
    cached = _cache_file(path, dtype)
    try:
        built = _from_json(cached.read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        built = _build(str(path.resolve()), dtype)
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(_to_json(built))
        except OSError:  # a read-only home: the next run builds again, nothing else changes
            pass
    shape, params, vocab, tied, declared = built
    return ModelSpec(str(model), shape, vocab, tied, str(path), params, declared)


def shape_from_config(cfg, dtype: torch.dtype) -> ModelShape:
    """The shape of a config's model, built on the meta device (no weights, no memory) at `dtype`."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from fate_lab.model.adapters import adapt

    cfg = dataclasses.replace(cfg) if dataclasses.is_dataclass(cfg) else cfg
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    a = adapt(model)
    scale = dtype.itemsize / next(model.parameters()).element_size()
    return ModelShape(len(getattr(model, "model", model).layers), a.num_moe_layers, a.num_experts, a.top_k,
                      a.hidden_size, a.expert_intermediate_size, dtype, int(a.dense_bytes() * scale),
                      int(a.kv_bytes_per_token(dtype)))
