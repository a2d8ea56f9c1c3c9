"""Local safetensors checkpoints of every family: one routed expert at a time, and a model without them.

What this file is: `ExpertIndex.build(model, folder)` maps every routed-expert tensor of a checkpoint
folder to (MoE layer m, expert e, tensor) through transformers' own loading rules (the renamings and
converters `from_pretrained` applies, from `conversion_mapping.get_model_conversion_mapping`), so
per-expert keys (`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1`,
Nemotron-H's `backbone...mixer.experts.{e}.up_proj`) and fused tensors (`mlp.experts.gate_up_proj`,
GraniteMoE's `input_linear`, read by slice) are both understood; `ExpertIndex.read(m, e)` returns
that expert's canonical `ExpertWeights` touching only its bytes. `load_without_experts(folder)`
builds the model with every non-expert tensor loaded and the routed experts left on the meta device
(no bytes), so that a checkpoint larger than RAM can be opened and offloaded.

What it is not: no store, cache or transfer (the offloading layer drives this); no downloads; no
dequantizer: a checkpoint whose experts are stored quantized is refused, naming what it holds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from fate_lab.model.experts import ExpertWeights, is_experts_module, layout_of
from fate_lab.model.folder import BadCheckpointFile, read_config, safetensors_keys, weight_files

_EXPERT_TENSORS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
_EXPERT_ID = re.compile(r"experts\.(\d+)\.")


def checkpoint_files(folder: str | Path) -> dict[str, Path]:
    """{key: file} over a checkpoint's safetensors files (the index's weight map, else every *.safetensors); a
    file that cannot be read is named (`folder.safetensors_keys`)."""
    out = {}
    for p in weight_files(folder):
        out.update(dict.fromkeys(safetensors_keys(p), p))
    return out


def _expert_safe(op, sources: int) -> bool:
    """True for a conversion op that never mixes experts, so it can run on one expert's slice alone
    (sources: how many of the converter's source patterns the checkpoint holds)."""
    name = type(op).__name__
    if name == "Inkling2LoopDequantizeExperts":
        return sources == 1  # with the float weight alone it passes it through; with scales it dequantizes
    if name == "MergeModulelist":
        return op.dim == 0  # stacks the per-expert tensors: over one expert, a stack of one
    if name in ("Concatenate", "Interleave"):
        return op.dim >= 1
    if name == "Transpose":
        return min(op.dim0, op.dim1) >= 1
    return False


@dataclass
class _Source:
    """Where one model tensor lives on disk: the transformers converter that builds it (None: a plain rename)
    and its checkpoint keys, by source pattern, whole ([E, ...] fused) or per expert."""

    target: str  # the model key
    converter: object | None = None
    whole: dict[str, tuple[Path, str]] = field(default_factory=dict)  # pattern -> (file, key)
    per_expert: dict[int, dict[str, tuple[Path, str]]] = field(default_factory=dict)  # e -> pattern -> (file, key)
    parts: dict[str, list[tuple[Path, str]]] = field(default_factory=dict)  # dense: pattern -> every (file, key)


def _load(file: Path, key: str, e: int | None = None) -> torch.Tensor:
    """A checkpoint tensor, or only expert e's slice of it (kept as a stack of one)."""
    with safe_open(str(file), framework="pt") as f:
        return _get(f, key, e)


def _get(f, key: str, e: int | None) -> torch.Tensor:
    return f.get_tensor(key) if e is None else f.get_slice(key)[e:e + 1]


class OpenFiles:
    """A `load` for `ExpertIndex.read` that keeps each safetensors file open for many reads: an open parses the
    file's header, milliseconds for a shard of a large MoE's thousands of keys, and a read of one expert takes
    three tensors. With `recheck`, one stat per read: a file replaced, truncated or deleted since it was opened is
    opened again (or fails), so a read never serves bytes of a file that is no longer there unnoticed."""

    def __init__(self, recheck: bool = False):
        self.recheck = recheck
        self._open: dict[Path, tuple] = {}  # file -> (its identity when opened, the open file)

    def __call__(self, file: Path, key: str, e: int | None = None) -> torch.Tensor:
        ident = None
        if self.recheck:
            st = os.stat(file)
            ident = (st.st_ino, st.st_size, st.st_mtime_ns)
        got = self._open.get(file)
        if got is None or got[0] != ident:
            got = self._open[file] = (ident, safe_open(str(file), framework="pt"))  # closed when dropped
        return _get(got[1], key, e)


def _run_ops(conv, collected: dict, target: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Run a transformers converter's own operations on collected {pattern: tensor(s)}, as from_pretrained does."""
    for op in conv.operations:
        collected = op.convert(collected, source_patterns=conv.source_patterns, target_patterns=conv.target_patterns,
                               full_layer_name=target, model=model, config=model.config, missing_keys=None)
    return collected


def _transforms(model: nn.Module):
    """(renamings, converters) transformers applies when loading this model's checkpoints."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _experts_names(model: nn.Module) -> dict[str, int]:
    """{module path: MoE layer m} of the model's experts modules, in the adapter's order."""
    from fate_lab.model.adapters import experts_modules

    return {path: m for m, (_, path, _) in enumerate(experts_modules(model))}


class ExpertIndex:
    """Where every routed expert (and every dense tensor) of a checkpoint folder lives."""

    def __init__(self, model: nn.Module, folder: Path, experts: dict[tuple[int, str], _Source],
                 dense: dict[str, _Source], refusals: list[str]):
        self.model, self.folder = model, folder
        self._experts = experts  # (m, tensor name) -> _Source
        self.dense = dense  # model key -> _Source of every non-expert tensor
        self.refusals = refusals  # what this checkpoint holds that fate_lab cannot read (empty: all readable)
        modules = dict(model.named_modules())
        self._modules = {m: modules[n] for n, m in _experts_names(model).items()}
        # read off now, while the modules hold their tensors (a runtime empties them later)
        self._layouts = {m: layout_of(mod) for m, mod in self._modules.items()}
        self._dtypes = {m: {n: t.dtype for n, t in mod.named_parameters(recurse=False)}
                        for m, mod in self._modules.items()}

    @classmethod
    def build(cls, model: nn.Module, folder: str | Path) -> ExpertIndex:
        """Index folder's keys for model (its meta or real instance) through transformers' loading rules."""
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        folder = Path(folder)
        renamings, converters = _transforms(model)
        meta_sd = dict.fromkeys(model.state_dict().keys(), True)
        names = _experts_names(model)
        experts: dict[tuple[int, str], _Source] = {}
        dense: dict[str, _Source] = {}
        refusals: list[str] = []
        files = checkpoint_files(folder)
        for key in sorted(files, key=dot_natural_key):  # from_pretrained's order (guarded renamings depend on it)
            file = files[key]
            target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_sd)
            if target not in meta_sd and key in meta_sd:  # as from_pretrained: a key the model already names stays
                target, pattern = rename_source_key(key, [], [], model.base_model_prefix, meta_sd)
            conv = None if pattern is None else next(c for c in converters if pattern in c.source_patterns)
            mod_path, _, name = target.rpartition(".")
            if mod_path not in names:
                src = dense.setdefault(target, _Source(target, conv))
                if conv is None:
                    src.whole[key] = (file, key)
                else:
                    src.parts.setdefault(pattern, []).append((file, key))
                continue
            m = names[mod_path]
            if name not in _EXPERT_TENSORS:
                refusals.append(f"{key} -> {target}: the experts of MoE layer {m} are stored with {name!r}, a "
                                "quantized format (scales/blocks) fate_lab has no dequantizer for; use a checkpoint "
                                "saved in a float dtype (bfloat16/float16/float32)")
                continue
            src = experts.setdefault((m, name), _Source(target, conv))
            hit = _EXPERT_ID.findall(key) if pattern is not None and "*" in pattern else []
            if hit:
                src.per_expert.setdefault(int(hit[-1]), {})[pattern] = (file, key)
            else:
                src.whole[pattern or key] = (file, key)
        for (m, _name), src in experts.items():
            present = set(src.whole) | {p for parts in src.per_expert.values() for p in parts}
            if src.converter is not None and not all(_expert_safe(op, len(present)) for op in src.converter.operations):
                refusals.append(f"{src.target} (MoE layer {m}): transformers builds it from {sorted(present)} with "
                                f"{[type(o).__name__ for o in src.converter.operations]}, which mixes experts or "
                                "dequantizes a quantized format; fate_lab reads one expert only through ops that act "
                                "on each expert alone: use a checkpoint saved in a float dtype")
        index = cls(model, folder, experts, dense, refusals)
        if not refusals:
            index._check_complete()
        return index

    def _check_complete(self) -> None:
        """BadCheckpointFile naming the routed-expert tensors the checkpoint lacks (a deleted key, a fused tensor
        with fewer experts than the model), so an incomplete checkpoint is refused when opened, not mid-generation."""
        gaps = []
        for m, layout in self._layouts.items():
            for name in layout.tensor_names().values():
                src = self._experts.get((m, name))
                if src is None:
                    gaps.append(f"every {name} of MoE layer {m}")
                    continue
                for file, key in src.whole.values():
                    with safe_open(str(file), framework="pt") as f:
                        rows = f.get_slice(key).get_shape()[0]
                    if rows < layout.num_experts:
                        gaps.append(f"experts {rows}..{layout.num_experts - 1} of {key} ({file.name} holds {rows} of "
                                    f"MoE layer {m}'s {layout.num_experts})")
                patterns = {p for parts in src.per_expert.values() for p in parts}
                for e in range(layout.num_experts if patterns else 0):
                    for pattern in sorted(patterns - set(src.per_expert.get(e, {}))):
                        other = next(parts[pattern][1] for parts in src.per_expert.values() if pattern in parts)
                        gaps.append(_EXPERT_ID.sub(f"experts.{e}.", other, count=1) + f" (expert {e} of MoE layer {m})")
        if gaps:
            raise BadCheckpointFile(f"{self.folder}: the checkpoint lacks {len(gaps)} routed-expert tensor(s) of this "
                                    f"{self.model.config.model_type!r} model, e.g. {gaps[:3]}: a tensor was deleted or "
                                    "a shard is missing; re-copy the checkpoint, or re-export it with save_pretrained")

    def describe(self, m: int) -> dict[str, str]:
        """{model tensor: where it lives on disk} for MoE layer m, keys shown with {i}/{e} for the numbers."""
        def pattern(key: str) -> str:
            return re.sub(r"experts\.\d+\.", "experts.{e}.", re.sub(r"layers\.\d+\.", "layers.{i}.", key))

        out = {}
        for (mm, name), src in self._experts.items():
            if mm != m:
                continue
            keys = [k for _, k in src.whole.values()] + [k for _, k in next(iter(src.per_expert.values()), {}).values()]
            how = "fused, read by slice" if src.whole else "per-expert keys"
            ops = f" + {[type(o).__name__ for o in src.converter.operations]}" if src.converter is not None else ""
            out[name] = f"{how}: {', '.join(pattern(k) for k in keys)}{ops}"
        return out

    def refusal(self) -> str | None:
        """Why this checkpoint's experts cannot be read one at a time (what to do), or None."""
        if self.refusals:
            return f"{self.folder}: " + "; ".join(self.refusals[:3]) + (
                f" (and {len(self.refusals) - 3} more)" if len(self.refusals) > 3 else "")
        return None

    def _tensor(self, m: int, e: int, name: str, load=_load) -> torch.Tensor:
        """Expert e's part of the model tensor `name` of MoE layer m, in the module's own layout."""
        src = self._experts.get((m, name))
        if src is None:
            raise KeyError(f"{self.folder}: no checkpoint tensor for {name} of MoE layer {m}; is this its checkpoint?")
        if src.converter is None:
            (file, key), = src.whole.values()
            return load(file, key, e)[0]
        collected = {pat: [load(*src.per_expert[e][pat])] if pat in src.per_expert.get(e, {})
                     else load(*src.whole[pat], e)
                     for pat in src.converter.source_patterns if pat in src.whole or pat in src.per_expert.get(e, {})}
        out = _run_ops(src.converter, collected, src.target, self.model)
        (tensor,) = out.values()
        return tensor[0]  # the stack of one expert

    def read(self, m: int, e: int, load=_load, cast: bool = True) -> ExpertWeights:
        """Expert e of MoE layer m from disk, canonical and in the model's dtype; only its bytes are read.
        load(file, key, e | None) -> tensor: how a checkpoint tensor (or expert e's slice, a stack of one) is read
        (default: safetensors' own reader; the disk link passes one that reads with O_DIRECT). cast=False keeps
        the loaded dtype (the disk link traces where each element comes from with integer tensors)."""
        reason = self.refusal()
        if reason is not None:
            raise NotImplementedError(reason)
        layout = self._layouts[m]
        if not 0 <= e < layout.num_experts:
            raise IndexError(f"expert {e} out of range: MoE layer {m} holds {layout.num_experts} experts")
        biases = [f"{layout.up_name}_bias", "down_proj_bias"] if layout.has_bias else []
        names = [layout.up_name, "down_proj"] + biases
        t = {n: self._tensor(m, e, n, load) for n in names}
        if cast:
            t = {n: x.to(self._dtypes[m][n]) for n, x in t.items()}
        up, down = t[layout.up_name], t["down_proj"]
        if layout.is_transposed:
            up, down = up.T, down.T  # (R, H), (H, I)
        want = {"up": (layout.rows, layout.hidden_size), "down": (layout.hidden_size, layout.intermediate_size)}
        for role, tensor in (("up", up), ("down", down)):
            if tuple(tensor.shape) != want[role]:
                raise ValueError(f"{self.folder}: expert {e} of MoE layer {m}: {role} projection has shape "
                                 f"{tuple(tensor.shape)}, the model's layout needs {want[role]}: not this model's "
                                 "checkpoint")
        return ExpertWeights(up, down, t.get(f"{layout.up_name}_bias"), t.get("down_proj_bias"))

    def where(self, m: int, e: int, name: str) -> str:
        """'file: key, ...' of the checkpoint tensors the module tensor `name` of expert e, MoE layer m comes from."""
        src = self._experts.get((m, name))
        if src is None:
            return f"{self.folder}: no tensor for {name}"
        pairs = list(src.whole.values()) + list(src.per_expert.get(e, {}).values())
        files = sorted({f.name for f, _ in pairs})
        return f"{', '.join(files)}: {', '.join(k for _, k in pairs)}"

    def files(self, m: int, e: int) -> list[Path]:
        """The checkpoint files expert e of MoE layer m is read from (for messages)."""
        out = []
        for (mm, _), src in self._experts.items():
            if mm == m:
                out += [f for f, _ in src.whole.values()] + [f for f, _ in src.per_expert.get(e, {}).values()]
        return list(dict.fromkeys(out))

    def where_dense(self, target: str) -> str:
        """'file: key, ...' of the checkpoint tensors the dense model tensor `target` is built from."""
        src = self.dense[target]
        pairs = list(src.whole.values()) + [fk for keys in src.parts.values() for fk in keys]
        return f"{', '.join(sorted({f.name for f, _ in pairs}))}: {', '.join(k for _, k in pairs)}"

    def dense_tensors(self, target: str, load=_load) -> dict[str, torch.Tensor]:
        """{model key: tensor} that the checkpoint source of `target` loads into, built as from_pretrained
        builds them (a plain rename, or the converter's own operations, e.g. a split fused projection)."""
        from transformers.core_model_loading import dot_natural_key

        src = self.dense[target]
        if src.converter is None:
            (file, key), = src.whole.values()
            return {target: load(file, key)}
        collected = {pat: [load(f, k) for f, k in sorted(keys, key=lambda fk: dot_natural_key(fk[1]))]
                     for pat, keys in src.parts.items()}
        out = _run_ops(src.converter, collected, target, self.model)
        prefix, _, suffix = next(target.partition(k) for k in out if k in target)
        return {prefix + k + suffix: v for k, v in out.items()}


def fp32_names(model: nn.Module, dtype: torch.dtype) -> set[str]:
    """Names of the tensors from_pretrained keeps in float32 when loading model in dtype (the class's
    `_keep_in_fp32_modules[_strict]`, e.g. DeepSeek-V3's `gate.weight` and `e_score_correction_bias`)."""
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)
    if not plan:
        return set()
    alternation, _, _ = build_glob_alternation(list(plan))
    return {n for n, _ in [*model.named_parameters(), *model.named_buffers()] if alternation.search(n)}


@dataclass(frozen=True)
class LoadReport:
    """What `load_without_experts` left out or had to initialise."""

    experts_on_meta: tuple[str, ...]  # the routed-expert tensors, never materialised
    initialised: tuple[str, ...]  # non-persistent buffers recomputed by the family's own _init_weights
    missing: tuple[str, ...]  # non-expert tensors the checkpoint lacks (initialised as from_pretrained does)


def load_without_experts(folder: str | Path, dtype: torch.dtype | None = None,
                         device: str | torch.device = "cpu") -> tuple[nn.Module, ExpertIndex, LoadReport]:
    """(model, expert index, report): every non-expert tensor loaded on device, the routed experts on meta.

    The experts stay meta tensors (no bytes) until an offloading runtime serves them (`ExpertIndex.read`); torch
    refuses `model.to(...)` while they are meta, and the model cannot run before.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    folder = Path(folder)
    config = read_config(folder)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{folder}: model_type {config.model_type!r} has no causal-LM class in transformers; "
                         "load_without_experts builds *ForCausalLM models")
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype or getattr(config, "dtype", None) or torch.float32)
    index = ExpertIndex.build(model, folder)
    if index.refusal() is not None:
        raise NotImplementedError(index.refusal())
    meta_sd = model.state_dict()
    keep_fp32 = fp32_names(model, dtype or model.dtype)
    state, load = {}, OpenFiles()
    for target in index.dense:
        for key, tensor in index.dense_tensors(target, load).items():
            if key not in meta_sd:
                continue
            if tensor.shape != meta_sd[key].shape:
                raise BadCheckpointFile(
                    f"{folder}: {index.where_dense(target)} has shape {tuple(tensor.shape)}, but the model "
                    f"that config.json describes needs {tuple(meta_sd[key].shape)} for {key}: config.json and "
                    "the weights are not the same model; copy config.json from the model the weights came from")
            state[key] = tensor.to(device=device, dtype=torch.float32 if key in keep_fp32 else meta_sd[key].dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    expert_ids = {id(p) for mod in model.modules() if is_experts_module(mod)
                  for p in mod.parameters(recurse=False)}
    initialised, missing = [], []
    with torch.no_grad():
        for name, mod in model.named_modules():
            meta = [(n, t) for n, t in [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
                    if t.is_meta and id(t) not in expert_ids]
            if not meta:
                continue
            keep = {n: t.detach().clone() for n, t in [*mod.named_parameters(recurse=False),
                                                       *mod.named_buffers(recurse=False)] if not t.is_meta}
            for n, t in meta:
                fresh = torch.empty_like(t, device=device)
                if n in mod._parameters:
                    mod._parameters[n] = nn.Parameter(fresh, requires_grad=t.requires_grad)
                else:
                    mod._buffers[n] = fresh
                full = f"{name}.{n}" if name else n
                (missing if full in meta_sd else initialised).append(full)
            model._init_weights(mod)
            for n, t in keep.items():
                getattr(mod, n).copy_(t)
    experts = tuple(n for n, p in model.named_parameters() if id(p) in expert_ids)
    return model.eval(), index, LoadReport(experts, tuple(initialised), tuple(missing))
