"""Open a checkpoint already offloaded: the routed experts stay in the files, only the dense weights load.

What this file is: `load_offloaded(path, config)`, for a model whose checkpoint is larger than RAM. It builds
the model with every non-expert tensor loaded on the device and the routed experts left on the meta device
(`model.checkpoint.load_without_experts`: shapes, no bytes), then offloads it with the SSD tier
(`store.SafetensorsStore`) reading each expert from the memory-mapped safetensors files when the cache asks
for it. The experts are never all in RAM or on the device: one is read (and its digest checked) at a time.
Opening reads every expert once to take its digest (the file is the only copy, so it is the reference) and
refuses non-finite values; every later read must match that digest.

Closing: the runtime has no copy of the experts to give back (none ever existed in memory), so after
`runtime.close()` the model's experts stay empty and every call of the model raises a RuntimeError that says
to open it again; nothing is read back from the files.
What it is not: a downloader (local folders only) or a converter of quantized checkpoints (refused by name).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fate_lab.core.config import OffloadConfig
from fate_lab.offloading.runtime import Runtime


def _tokenizer(path: Path):
    """The folder's tokenizer, or None when it holds no tokenizer files."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
    if not any((path / n).is_file() for n in names):
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _check_dense(model: nn.Module, path: Path) -> None:
    """ValueError naming the first loaded (non-expert) parameter that holds NaN/inf."""
    for name, p in model.named_parameters():
        if not p.is_meta and p.is_floating_point() and not bool(torch.isfinite(p).all()):
            raise ValueError(f"{path}: parameter {name!r} holds non-finite values (NaN/inf) after loading; the "
                             "checkpoint is corrupt: re-export or re-copy it")


def _check_expert_math(model: nn.Module, index) -> None:
    """NotImplementedError when the installed transformers computes a layer's experts otherwise than fate_lab
    (`model.experts.math_refusal`, probed with the first experts read from the files: the model holds none)."""
    from fate_lab.model.adapters import adapt
    from fate_lab.model.experts import math_refusal

    adapter = adapt(model)
    probed = set()
    for m in range(adapter.num_moe_layers):
        mod = adapter.experts_module(m)
        if type(mod) in probed:
            continue
        probed.add(type(mod))
        experts = [index.read(m, e) for e in range(min(2, adapter.num_experts))]  # on the CPU, as the probe runs
        reason = math_refusal(mod, adapter.family, experts)
        if reason is not None:
            raise NotImplementedError(f"fate_lab cannot offload MoE layer {m}: {reason}")


def load_offloaded(path: str | Path, config: OffloadConfig | None = None, dtype: torch.dtype | str | None = None,
                   device: str | torch.device = "cpu") -> tuple[nn.Module, object, Runtime]:
    """(model, tokenizer or None, runtime): the checkpoint folder's model offloaded per config (default: the `fate`
    preset) with its routed experts served from the files (store="ssd"); see the module docstring for close()."""
    from fate_lab.model.checkpoint import load_without_experts
    from fate_lab.model.families import experts_interface_families
    from fate_lab.model.models import resolve_dtype

    path = Path(path)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint folder (config.json + *.safetensors); load_offloaded "
                                "opens a local folder written by save_pretrained")
    config = config or OffloadConfig.preset("fate", store="ssd")
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig (e.g. OffloadConfig.preset('fate', store='ssd')), got "
                        f"{type(config).__name__}")
    if config.store.kind != "ssd":
        raise ValueError(f"OffloadConfig.store={config.store.kind!r}: load_offloaded serves the experts from the "
                         "checkpoint files, store='ssd' (use load_model + offload to hold every expert in RAM)")
    if config.checkpoint is not None and Path(config.checkpoint).resolve() != path.resolve():
        raise ValueError(f"OffloadConfig.checkpoint={config.checkpoint!r} is not the folder opened ({path}); leave it "
                         "None, load_offloaded sets it")
    if config.auto is not None:
        raise ValueError(f"OffloadConfig {config.name!r} plans itself from a calibration that runs every expert "
                         "resident "
                         "and records a trace, which a model opened with load_offloaded cannot do (its experts stay on "
                         "disk): name a preset (e.g. 'fate'), or plan where the model fits in memory "
                         "(fate_lab.study.auto.plan_auto) and pass the config it returns")
    config = config.replace(checkpoint=str(path))
    model, index, report = load_without_experts(path, resolve_dtype(dtype), device)
    if model.config.model_type not in experts_interface_families():
        raise ValueError(f"{path} is a {model.config.model_type!r} model; load_offloaded opens causal-LM MoE families "
                         f"whose transformers modeling uses the experts interface: {experts_interface_families()}")
    if report.missing:
        raise ValueError(f"{path}: the checkpoint lacks {len(report.missing)} non-expert tensors, e.g. "
                         f"{list(report.missing[:3])}; they would run randomly initialised: "
                         "use the complete checkpoint")
    _check_dense(model, path)
    _check_expert_math(model, index)
    tokenizer = _tokenizer(path)
    return model, tokenizer, Runtime(model, config, index=index)
