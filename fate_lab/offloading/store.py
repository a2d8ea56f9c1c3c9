"""Host store: where every routed expert's weights live while they are off the device.

What this file is: two tiers behind one small interface, `fetch(m, e) -> ExpertTensors`
(the expert's fused-layout rows: gate_up [2I, H], down [H, I]):
- `RamStore`: one contiguous host copy per expert, pinned when a CUDA device is used (so the
  copy engine can DMA asynchronously);
- `SafetensorsStore`: the SSD tier; each fetch opens the checkpoint with `safe_open`
  (memory-mapped) and reads only that expert's tensors (per-expert keys as HF writes them,
  Mixtral's w1/w3/w2 names, or fused `gate_up_proj`/`down_proj` keys read by slice);
- `QuantizedStore`: wraps either tier and adds packed copies (`PackedExpert`, one per
  precision a `quant.QuantPolicy` names for the layer, `policy.host_specs(m)`), read with
  `fetch_at(m, e, spec)`. Fate keeps an INT4 and an INT2 copy of every expert on the host; so
  does this store under the `fate` policy. The packed copies always live in RAM (pinned on
  CUDA), also over the SSD tier: quantizing at load time, not writing packed files, is a
  simplification of ours.

What it is not: it owns no device memory and no thread; the transfer engine moves the bytes.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from fate_lab.quant import QuantSpec, QuantizedTensor, quantize


@dataclass(frozen=True)
class ExpertTensors:
    """One expert's weights in the fused layout the HF experts modules use."""

    gate_up: torch.Tensor  # (2I, H) gate rows stacked over up rows
    down: torch.Tensor  # (H, I)

    @property
    def nbytes(self) -> int:
        """Bytes of both tensors."""
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))


@dataclass(frozen=True)
class PackedExpert:
    """One expert quantized: packed codes + fp16 scale/zero of its fused-layout tensors."""

    gate_up: QuantizedTensor  # (2I, H) groups along H
    down: QuantizedTensor  # (H, I) groups along I

    @property
    def nbytes(self) -> int:
        """Packed bytes of both tensors, scales and zeros included (what travels)."""
        return self.gate_up.nbytes() + self.down.nbytes()

    @property
    def spec(self) -> QuantSpec:
        """The precision both tensors are at."""
        return self.gate_up.spec

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedExpert":
        """A copy on device: the packed bytes move, not dequantized weights."""
        return PackedExpert(self.gate_up.to(device, non_blocking), self.down.to(device, non_blocking))

    def pin_memory(self) -> "PackedExpert":
        """A copy in page-locked host memory."""
        return PackedExpert(self.gate_up.pin_memory(), self.down.pin_memory())


class HostStore:
    """Interface: every routed expert of every MoE layer, readable by (m, e)."""

    tier = "base"
    num_moe_layers: int
    num_experts: int

    def fetch(self, m: int, e: int) -> ExpertTensors:  # pragma: no cover - interface
        """Host tensors of expert e of MoE layer m."""
        raise NotImplementedError

    def fetch_at(self, m: int, e: int, spec: QuantSpec | None) -> ExpertTensors | PackedExpert:
        """Expert e of MoE layer m at a precision: None is full precision (`fetch`)."""
        if spec is None:
            return self.fetch(m, e)
        raise ValueError(f"the {self.describe()} store keeps no packed {spec} copies; wrap it in "
                         f"QuantizedStore (OffloadConfig(quant=...)) to move quantized experts")

    def nbytes_at(self, m: int, e: int, spec: QuantSpec) -> int:
        """Bytes of the packed copy of (m, e) at spec (what a quantized transfer moves)."""
        return self.fetch_at(m, e, spec).nbytes

    def layer(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts of MoE layer m fused back: (gate_up [E, 2I, H], down [E, H, I])."""
        parts = [self.fetch(m, e) for e in range(self.num_experts)]
        return torch.stack([p.gate_up for p in parts]), torch.stack([p.down for p in parts])

    def describe(self) -> str:
        """A short name of the tier for outputs."""
        return self.tier


class RamStore(HostStore):
    """Experts in host RAM, one contiguous (optionally pinned) pair of tensors per expert."""

    tier = "ram"

    def __init__(self, experts: list[list[ExpertTensors]], pinned: bool):
        self._experts = experts  # [m][e]
        self.pinned = pinned
        self.num_moe_layers = len(experts)
        self.num_experts = len(experts[0])

    @classmethod
    def from_adapter(cls, adapter, pin: bool = False) -> "RamStore":
        """Every expert of the model in host RAM: views of the fused tensors when they already live in
        host memory and need no pinning (no copy), else a (pinned if pin) host copy."""

        def host(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu" and not pin:
                return t.detach()  # a view: the model's own bytes, not a second copy
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            out.copy_(t.detach())
            return out

        layers = []
        for m in range(adapter.num_moe_layers):
            mod = adapter.experts_module(m)
            layers.append([ExpertTensors(host(mod.gate_up_proj[e]), host(mod.down_proj[e]))
                           for e in range(adapter.num_experts)])
        return cls(layers, pinned=pin)

    def fetch(self, m: int, e: int) -> ExpertTensors:
        """The stored tensors themselves (no copy)."""
        return self._experts[m][e]

    def describe(self) -> str:
        """'ram (pinned)' or 'ram'."""
        return "ram (pinned)" if self.pinned else "ram"


_PER_EXPERT = re.compile(r"^(?P<pre>.*)layers\.(?P<i>\d+)\.(?P<blk>mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                         r"(?P<w>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_FUSED = re.compile(r"^(?P<pre>.*)layers\.(?P<i>\d+)\.mlp\.experts\.(?P<w>gate_up_proj|down_proj)$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


class SafetensorsStore(HostStore):
    """The SSD tier: reads one expert at a time from the checkpoint's safetensors file(s)."""

    tier = "ssd"

    def __init__(self, path: str | Path, moe_layers: list[int], num_experts: int, dtype: torch.dtype):
        """path: a .safetensors file or a checkpoint folder; moe_layers: decoder index per MoE layer."""
        self.path = Path(path)
        self.dtype = dtype
        self.num_moe_layers = len(moe_layers)
        self.num_experts = num_experts
        files = self._files()
        per_expert: dict[tuple[int, int, str], tuple[Path, str]] = {}
        fused: dict[tuple[int, str], tuple[Path, str]] = {}
        for file, keys in files.items():
            for key in keys:
                if (mt := _PER_EXPERT.match(key)) is not None:
                    per_expert[int(mt["i"]), int(mt["e"]), _ROLE[mt["w"]]] = (file, key)
                elif (mt := _FUSED.match(key)) is not None:
                    fused[int(mt["i"]), mt["w"]] = (file, key)
        self._keys: list[list[dict]] = []
        for i in moe_layers:
            row = []
            for e in range(num_experts):
                if all((i, e, r) in per_expert for r in ("gate", "up", "down")):
                    row.append({r: per_expert[i, e, r] for r in ("gate", "up", "down")})
                elif (i, "gate_up_proj") in fused and (i, "down_proj") in fused:
                    row.append({"fused": (fused[i, "gate_up_proj"], fused[i, "down_proj"])})
                else:
                    raise ValueError(
                        f"{self.path}: no weights for expert {e} of decoder layer {i}; expected keys like "
                        f"'model.layers.{i}.mlp.experts.{e}.gate_proj.weight'. Is this the model's checkpoint?"
                    )
            self._keys.append(row)

    def _files(self) -> dict[Path, list[str]]:
        """Each safetensors file of the checkpoint with the keys it holds."""
        if self.path.is_file():
            paths = [self.path]
        else:
            index = self.path / "model.safetensors.index.json"
            if index.exists():
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
                paths = [self.path / n for n in names]
            else:
                paths = sorted(self.path.glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no .safetensors file at {self.path}; save the model with save_pretrained first")
        out = {}
        for p in paths:
            with safe_open(str(p), framework="pt") as f:
                out[p] = list(f.keys())
        return out

    def fetch(self, m: int, e: int) -> ExpertTensors:
        """Read expert e of MoE layer m from disk (only its bytes are touched)."""
        spec = self._keys[m][e]
        if "fused" in spec:
            (f_gu, k_gu), (f_d, k_d) = spec["fused"]
            with safe_open(str(f_gu), framework="pt") as f:
                gate_up = f.get_slice(k_gu)[e]  # (2I, H)
            with safe_open(str(f_d), framework="pt") as f:
                down = f.get_slice(k_d)[e]  # (H, I)
        else:
            parts = {}
            for role, (file, key) in spec.items():
                with safe_open(str(file), framework="pt") as f:
                    parts[role] = f.get_tensor(key)
            gate_up = torch.cat([parts["gate"], parts["up"]], dim=0)  # (2I, H)
            down = parts["down"]  # (H, I)
        return ExpertTensors(gate_up.to(self.dtype).contiguous(), down.to(self.dtype).contiguous())

    def verify(self, adapter) -> None:
        """Refuse a checkpoint that is not the in-memory model: every expert's keys, shapes, dtypes, and its
        first and last rows (gate, up, down) must equal the model's; the error names the first difference.
        Reads only those rows, so it is cheap enough to run at every offload."""
        inter = adapter.expert_intermediate_size
        for m in range(self.num_moe_layers):
            mod = adapter.experts_module(m)
            for e in range(self.num_experts):
                mine = {"gate": mod.gate_up_proj[e, :inter], "up": mod.gate_up_proj[e, inter:], "down": mod.down_proj[e]}
                spec = self._keys[m][e]
                for role, ref in mine.items():
                    if "fused" in spec:
                        (f_gu, k_gu), (f_d, k_d) = spec["fused"]
                        file, key = (f_d, k_d) if role == "down" else (f_gu, k_gu)
                    else:
                        file, key = spec[role]
                    with safe_open(str(file), framework="pt") as f:
                        sl = f.get_slice(key)
                        shape = list(sl.get_shape())
                        if "fused" in spec:
                            want = [self.num_experts, *mod.gate_up_proj.shape[1:]] if role != "down" else \
                                [self.num_experts, *mod.down_proj.shape[1:]]
                        else:
                            want = list(ref.shape)
                        if shape != want:
                            raise ValueError(f"checkpoint {file.name}: {key} has shape {shape}, the model's expert "
                                             f"{e} of MoE layer {m} ({role}) {want}: not this model's checkpoint")
                        if "fused" in spec:
                            rows = sl[e]  # (2I, H) or (H, I)
                            rows = rows[:inter] if role == "gate" else rows[inter:] if role == "up" else rows
                            got = torch.stack([rows[0], rows[-1]])
                        else:
                            got = torch.cat([sl[0:1], sl[shape[0] - 1:shape[0]]])  # first and last rows only
                    if got.dtype != ref.dtype and not torch.equal(got.to(ref.dtype).to(got.dtype), got):
                        raise ValueError(f"checkpoint {file.name}: {key} is {got.dtype}, which {ref.dtype} cannot hold "
                                         "exactly")
                    if not torch.equal(got.to(ref.dtype), torch.stack([ref[0], ref[-1]]).detach().cpu()):
                        raise ValueError(f"checkpoint {file.name}: {key} differs from the in-memory model's expert {e} "
                                         f"of MoE layer {m} ({role}): the checkpoint is not these weights (edited "
                                         "or another model); save the model (save_pretrained) and pass that folder")

    def describe(self) -> str:
        """'ssd (<path>)'."""
        return f"ssd ({self.path})"


class QuantizedStore(HostStore):
    """Packed copies of every expert at each precision the policy needs, over a full-precision store."""

    def __init__(self, base: HostStore, specs: list[tuple[QuantSpec | None, ...]], pin: bool = False):
        """specs[m]: the precisions to keep for MoE layer m (None entries are served by base)."""
        if len(specs) != base.num_moe_layers:
            raise ValueError(f"need one tuple of specs per MoE layer ({base.num_moe_layers}), got {len(specs)}")
        self.base = base
        self.tier = base.tier
        self.num_moe_layers, self.num_experts = base.num_moe_layers, base.num_experts
        self.specs = [tuple(s) for s in specs]
        self.pinned = pin
        self._packed: dict[tuple[int, int, QuantSpec], PackedExpert] = {}
        for m, layer_specs in enumerate(self.specs):
            for spec in layer_specs:
                if spec is None:
                    continue
                for e in range(self.num_experts):
                    src = base.fetch(m, e)
                    try:
                        packed = PackedExpert(quantize(src.gate_up, spec), quantize(src.down, spec))
                    except ValueError as exc:
                        raise ValueError(f"cannot quantize expert {e} of MoE layer {m} at {spec}: {exc}. Choose a "
                                         f"group size that divides hidden and expert width {tuple(src.down.shape)}"
                                         ) from exc
                    self._packed[m, e, spec] = packed.pin_memory() if pin else packed

    def fetch(self, m: int, e: int) -> ExpertTensors:
        """Full-precision tensors, from the wrapped store."""
        return self.base.fetch(m, e)

    def fetch_at(self, m: int, e: int, spec: QuantSpec | None) -> ExpertTensors | PackedExpert:
        """The packed copy at spec (None: full precision from the wrapped store)."""
        if spec is None:
            return self.base.fetch(m, e)
        try:
            return self._packed[m, e, spec]
        except KeyError:
            raise ValueError(f"no packed copy of expert {e} of MoE layer {m} at {spec}; this store keeps "
                             f"{self.specs[m]} for that layer") from None

    def describe(self) -> str:
        """The wrapped tier plus the packed precisions kept, e.g. 'ram + packed int4/g64, int2/g32'."""
        kept = sorted({s for layer in self.specs for s in layer if s is not None}, key=lambda s: -s.bits)
        return f"{self.base.describe()} + packed " + ", ".join(f"int{s.bits}/g{s.group_size}" for s in kept)
