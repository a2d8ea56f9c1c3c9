"""Host store: where every routed expert's weights live while they are off the device.

What this file is: two tiers behind one small interface, `fetch(m, e) -> ExpertWeights` (the expert's
canonical tensors, `model.experts`: up or gate-and-up [R, H], down [H, I], and biases where the family has
them), for every experts layout the model side serves:
- `RamStore`: every expert in host RAM, read through `MoEAdapter.expert(m, e)`: on a CPU the model's own
  bytes (views, no copy), on an accelerator a contiguous copy, pinned on CUDA (so the copy engine can DMA
  asynchronously);
- `SafetensorsStore`: the SSD tier; each fetch reads only that expert's bytes from the checkpoint through
  `model.checkpoint.ExpertIndex` (memory-mapped `safe_open`; per-expert keys, fused tensors read by slice,
  transformers' own renamings). It never computes with other weights than the ones it was opened on: at
  open it takes a full-content digest of every expert (`digest.expert_digest`) from the model's own tensors
  and refuses a checkpoint whose experts differ (naming the file, the expert and the first differing row),
  or -- opened from the checkpoint alone (`load_offloaded`), where no other copy exists -- from the file,
  refusing non-finite values; every later read is digested again and refused (`CheckpointError`) if it
  changed since;
- `QuantizedStore`: wraps either tier and adds packed copies (`quant.PackedExpert`, one per precision a
  `quant.QuantPolicy` names for the layer, `policy.host_specs(m)`), read with `fetch_at(m, e, spec)`. Fate
  keeps an INT4 and an INT2 copy of every expert on the host; so does this store under the `fate` policy.
  The packed copies live in RAM (pinned on CUDA), also over the SSD tier; the disk link writes them to a file
  once instead (`packed_file.py`).

What it is not: it owns no device memory and no thread; the transfer engine moves the bytes.
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from fate_lab.model.checkpoint import ExpertIndex, OpenFiles
from fate_lab.model.experts import ExpertWeights
from fate_lab.offloading.digest import expert_digest, first_difference, nonfinite
from fate_lab.quant import PackedExpert, QuantSpec, pack_expert

__all__ = ["CheckpointError", "ExpertWeights", "HostStore", "PackedExpert", "QuantizedStore", "RamStore",
           "SafetensorsStore"]


class CheckpointError(RuntimeError):
    """The SSD tier read an expert that is not the one it verified (the file changed, vanished or is corrupt)."""


class HostStore:
    """Interface: every routed expert of every MoE layer, readable by (m, e)."""

    tier = "base"
    num_moe_layers: int
    num_experts: int

    def fetch(self, m: int, e: int) -> ExpertWeights:  # pragma: no cover - interface
        """Host tensors of expert e of MoE layer m (canonical layout)."""
        raise NotImplementedError

    def fetch_at(self, m: int, e: int, spec: QuantSpec | None) -> ExpertWeights | PackedExpert:
        """Expert e of MoE layer m at a precision: None is full precision (`fetch`)."""
        if spec is None:
            return self.fetch(m, e)
        raise ValueError(f"the {self.describe()} store keeps no packed {spec} copies; wrap it in "
                         f"QuantizedStore (OffloadConfig(quant=...)) to move quantized experts")

    def nbytes_at(self, m: int, e: int, spec: QuantSpec) -> int:
        """Bytes of the packed copy of (m, e) at spec (what a quantized transfer moves)."""
        return self.fetch_at(m, e, spec).nbytes

    def read_into(self, m: int, e: int, spec: QuantSpec | None, regions: dict) -> bool:
        """Read (m, e) at spec straight into a slot's bytes (`DeviceSlots.regions`), checked as `fetch_at` checks
        it; False (nothing read) where this store cannot: the caller copies `fetch_at`'s tensors in instead."""
        return False

    def describe(self) -> str:
        """A short name of the tier for outputs."""
        return self.tier


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A contiguous host copy of t (page-locked if pin)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    out.copy_(t.detach())
    return out


class RamStore(HostStore):
    """Experts in host RAM, one `ExpertWeights` per expert (the model's own bytes on a CPU, else a copy)."""

    tier = "ram"

    def __init__(self, experts: list[list[ExpertWeights]], pinned: bool):
        self._experts = experts  # [m][e]
        self.pinned = pinned
        self.num_moe_layers = len(experts)
        self.num_experts = len(experts[0])

    @classmethod
    def from_adapter(cls, adapter, pin: bool = False) -> RamStore:
        """Every expert of the model in host RAM: views of the module tensors when they already live in host
        memory and need no pinning (no copy), else a contiguous (pinned if pin) host copy."""
        layers = []
        for m in range(adapter.num_moe_layers):
            row = []
            for e in range(adapter.num_experts):
                w = adapter.expert(m, e)  # views of the module's tensors
                if any(t.is_meta for t in w.tensors().values()):
                    raise ValueError(f"{adapter.family}: the experts of MoE layer {m} are on the meta device (no "
                                     "bytes; e.g. opened with load_offloaded): store='ram' cannot hold them; use "
                                     "store='ssd' with the checkpoint folder")
                keep = all(t.device.type == "cpu" for t in w.tensors().values()) and not pin
                row.append(ExpertWeights(**{n: t.detach() if keep else _host_copy(t, pin)
                                            for n, t in w.tensors().items()}))
            layers.append(row)
        return cls(layers, pinned=pin)

    def fetch(self, m: int, e: int) -> ExpertWeights:
        """The stored tensors themselves (no copy)."""
        return self._experts[m][e]

    def describe(self) -> str:
        """'ram (pinned)' or 'ram'."""
        return "ram (pinned)" if self.pinned else "ram"


class SafetensorsStore(HostStore):
    """The SSD tier: reads one expert at a time from the checkpoint, each read checked against its digest."""

    tier = "ssd"

    def __init__(self, index: ExpertIndex, num_moe_layers: int, num_experts: int, digests: list[list[int]],
                 reference: str):
        """Use `SafetensorsStore.open`; digests[m][e] is what every read of (m, e) must hash to."""
        self.index, self.path = index, Path(index.folder)
        self.num_moe_layers, self.num_experts = num_moe_layers, num_experts
        self.digests = digests
        self.reference = reference  # "model": digests of the in-memory model's tensors; "file": of the file at open
        self._local = threading.local()  # per reading thread: its open files, its read buffer (disk link)

    @classmethod
    def open(cls, adapter, checkpoint: str | Path, index: ExpertIndex | None = None, progress: bool = False
             ) -> SafetensorsStore:
        """The SSD tier over checkpoint for the adapted model, verified in full before anything is freed.

        With the model's experts in memory, every expert read from the file must hash to the digest of the
        model's own tensors (ValueError naming the file, the expert and where it differs). With them on the
        meta device (`load_offloaded`: the file is the only copy) the digests are taken from the file, and an
        expert holding NaN/inf is refused. Costs one full read of the checkpoint's experts."""
        from tqdm.auto import tqdm

        if index is None:
            index = ExpertIndex.build(adapter.model, checkpoint)
        if index.refusal() is not None:
            raise NotImplementedError(index.refusal())
        M, E = adapter.num_moe_layers, adapter.num_experts
        meta = any(t.is_meta for t in adapter.expert(0, 0).tensors().values())
        digests, load = [], OpenFiles()
        bar = tqdm(total=M * E, desc="verify checkpoint", unit="expert", disable=not progress)
        for m in range(M):
            row, layout = [], adapter.layouts[m]
            for e in range(E):
                where = f"checkpoint {index.folder} ({', '.join(p.name for p in index.files(m, e))})"
                try:
                    theirs = index.read(m, e, load=load)
                except (KeyError, ValueError) as exc:
                    raise ValueError(f"{where}: expert {e} of MoE layer {m} cannot be read as this model's: "
                                     f"{exc}") from exc
                d = expert_digest(theirs)
                if meta:
                    bad = nonfinite(theirs)
                    if bad is not None:
                        raise ValueError(f"{where}: expert {e} of MoE layer {m}: {bad}; the checkpoint is "
                                         "corrupt: re-export or re-copy it")
                else:
                    mine = adapter.expert(m, e)
                    if expert_digest(mine) != d:
                        field, how = first_difference(mine, theirs)
                        if field is not None:
                            where = f"checkpoint {index.folder} ({index.where(m, e, layout.tensor_names()[field])})"
                        raise ValueError(
                            f"{where}: expert {e} of MoE layer {m} differs from the in-memory model's ({how}): the "
                            "checkpoint is not these weights (edited, corrupt or another model); save the model "
                            "(save_pretrained) and pass that folder")
                row.append(d)
                bar.update(1)
            digests.append(row)
        bar.close()
        return cls(index, M, E, digests, "file" if meta else "model")

    def fetch(self, m: int, e: int) -> ExpertWeights:
        """Read expert e of MoE layer m from disk (only its bytes are touched), refused unless it hashes to the
        digest taken at open."""
        files = getattr(self._local, "files", None)
        if files is None:  # this thread's open files, each rechecked on disk at every read
            files = self._local.files = OpenFiles(recheck=True)
        try:
            w = self.index.read(m, e, load=files)
        except Exception as exc:  # a vanished, truncated or replaced file: name it and the expert
            raise CheckpointError(f"cannot read expert {e} of MoE layer {m} from {self._where(m, e)}: {exc!r}; "
                                  "the checkpoint changed or vanished while offloaded") from exc
        return self._verified(m, e, w)

    def _verified(self, m: int, e: int, w: ExpertWeights) -> ExpertWeights:
        """w, refused unless it hashes to the digest expert e of MoE layer m had at offload."""
        if expert_digest(w) != self.digests[m][e]:
            bad = nonfinite(w)
            raise CheckpointError(
                f"expert {e} of MoE layer {m} read from {self._where(m, e)} is not the expert verified at offload "
                f"(its digest changed{'; ' + bad if bad else ''}): the checkpoint was edited, swapped or corrupted "
                "while offloaded; fate_lab refuses to compute with it. Offload again from an unchanged checkpoint")
        return w

    def _where(self, m: int, e: int) -> str:
        return f"{self.path} ({', '.join(p.name for p in self.index.files(m, e))})"

    def describe(self) -> str:
        """'ssd (<path>)'."""
        return f"ssd ({self.path})"


class QuantizedStore(HostStore):
    """Packed copies of every expert at each precision the policy needs, over a full-precision store."""

    def __init__(self, base: HostStore, specs: list[tuple[QuantSpec | None, ...]], pin: bool = False):
        """specs[m]: the precisions to keep for MoE layer m (None entries are served by base)."""
        self._wrap(base, specs, pin)
        self._packed: dict[tuple[int, int, QuantSpec], PackedExpert] = {
            (m, e, spec): packed.pin_memory() if pin else packed for m, e, spec, packed in self._packed_items()}

    def _wrap(self, base: HostStore, specs: list[tuple[QuantSpec | None, ...]], pin: bool) -> None:
        if len(specs) != base.num_moe_layers:
            raise ValueError(f"need one tuple of specs per MoE layer ({base.num_moe_layers}), got {len(specs)}")
        self.base, self.tier, self.pinned = base, base.tier, pin
        self.num_moe_layers, self.num_experts = base.num_moe_layers, base.num_experts
        self.specs = [tuple(s) for s in specs]

    def _packed_items(self, progress: bool = False):
        """(m, e, spec, packed copy) of every expert at every precision kept, packed from the wrapped store."""
        from tqdm.auto import tqdm

        todo = [(m, e, s) for m, ss in enumerate(self.specs) for s in ss if s is not None
                for e in range(self.num_experts)]
        for m, e, spec in tqdm(todo, desc="packing experts", unit="expert", disable=not progress):
            src = self.base.fetch(m, e)
            try:
                yield m, e, spec, pack_expert(src, spec, name=f"expert {e} of MoE layer {m}")
            except ValueError as exc:
                raise ValueError(f"cannot quantize expert {e} of MoE layer {m} at {spec}: {exc}. Choose a group "
                                 f"size that divides hidden and expert width {tuple(src.down.shape)}") from exc

    def fetch(self, m: int, e: int) -> ExpertWeights:
        """Full-precision tensors, from the wrapped store."""
        return self.base.fetch(m, e)

    def fetch_at(self, m: int, e: int, spec: QuantSpec | None) -> ExpertWeights | PackedExpert:
        """The packed copy at spec (None: full precision from the wrapped store)."""
        if spec is None:
            return self.base.fetch(m, e)
        try:
            return self._packed[m, e, spec]
        except KeyError:
            raise ValueError(f"no packed copy of expert {e} of MoE layer {m} at {spec}; this store keeps "
                             f"{self.specs[m]} for that layer") from None

    def read_into(self, m: int, e: int, spec: QuantSpec | None, regions: dict) -> bool:
        """Full precision straight into a slot where the wrapped store can (the packed copies live in memory)."""
        return spec is None and self.base.read_into(m, e, None, regions)

    def describe(self) -> str:
        """The wrapped tier plus the packed precisions kept, e.g. 'ram + packed int4/g64, int2/g32'."""
        kept = sorted({s for layer in self.specs for s in layer if s is not None}, key=lambda s: -s.bits)
        return f"{self.base.describe()} + packed " + ", ".join(f"int{s.bits}/g{s.group_size}" for s in kept)
