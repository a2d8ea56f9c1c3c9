"""The runtime's mechanisms, built from what the driver core planned: host store, device slots, link engine.

What this file is: `build_store` (host RAM, pinned on CUDA, or the SSD tier read from a checkpoint and checked
against full-content digests, wrapped with packed copies when the config quantizes), `build_slots`
(full-precision or packed device slots, as many as the core's plan counts) and `build_engine` (the instant link,
an emulated link on its own thread, or the CUDA copy stream). What it is not: a policy (the core decided the sizes)
or the runtime that wires them.
"""
from __future__ import annotations

import torch

from fate_lab.core.driver import DriverCore
from fate_lab.core.sizing import SCRATCH_SLOTS
from fate_lab.hardware.links import LinkProfile
from fate_lab.hardware.setups import is_scaled
from fate_lab.model.adapters import MoEAdapter
from fate_lab.model.checkpoint import ExpertIndex
from fate_lab.offloading.disk import DiskEngine, DiskStore
from fate_lab.offloading.packed_file import DiskQuantizedStore
from fate_lab.offloading.slots import DeviceSlots, FullSlots, PackedSlots
from fate_lab.offloading.store import HostStore, QuantizedStore, RamStore, SafetensorsStore
from fate_lab.offloading.transfer import CudaCopyEngine, EmulatedEngine, InstantEngine, TransferEngine


def build_store(core: DriverCore, adapter: MoEAdapter, device: torch.device, index: ExpertIndex | None = None
                ) -> HostStore:
    """Every routed expert on the host: RAM (the model's own bytes on a CPU; a pinned copy on CUDA) or the SSD
    tier (verified in full against the model, or against the file when the model holds no experts, before
    anything is freed), plus packed copies when quantizing. index: an `ExpertIndex` already built for the
    checkpoint (`load_offloaded`)."""
    cfg = core.config
    pin = device.type == "cuda"
    if cfg.store.kind == "ram":
        base: HostStore = RamStore.from_adapter(adapter, pin=pin)
    else:
        if cfg.checkpoint is None and index is None:
            raise ValueError("OffloadConfig(store='ssd') needs checkpoint=<safetensors file or folder of the model>")
        tier = DiskStore if cfg.link.name == "disk" else SafetensorsStore  # the disk link reads with O_DIRECT
        base = tier.open(adapter, cfg.checkpoint if index is None else index.folder, index=index)
    if core.quant is None:
        return base
    specs = [core.quant.host_specs(m) for m in range(adapter.num_moe_layers)]
    if base.tier == "disk":  # packed once into a file, so a quantized load reads its fewer bytes from the disk
        return DiskQuantizedStore(base, specs)
    return QuantizedStore(base, specs, pin=pin)


def build_slots(core: DriverCore, dtype: torch.dtype, device: torch.device) -> DeviceSlots:
    """The device slots the core's plan counts: full precision, or packed with a dequantize scratch."""
    shapes = core.shape.expert_shapes()
    if core.quant is None:
        return FullSlots.empty(core.num_slots, shapes, dtype, device)
    slots = PackedSlots(shapes, core.slot_specs, dtype, core.num_slots, SCRATCH_SLOTS, device)
    if slots.slot_bytes != core.slot_bytes:
        raise RuntimeError(f"packed slots hold {slots.slot_bytes} bytes, the plan counted {core.slot_bytes} (a bug)")
    return slots


def build_engine(store: HostStore, slots: DeviceSlots, link: LinkProfile | None, device: torch.device,
                 native: bool, timeout_s: float, direct: bool = False) -> TransferEngine:
    """The link engine: instant (link None), the CUDA copy stream (native on CUDA), or an emulated link; on the disk,
    `direct` reads straight into the slots (`OffloadConfig(direct_reads=True)`)."""
    if link is None:
        return InstantEngine(store, slots)
    if store.tier == "disk":  # link="disk": real reads, queue_depth reader threads
        return DiskEngine(store, slots, link, timeout_s=timeout_s, direct=direct)
    if device.type == "cuda" and native:
        return CudaCopyEngine(store, slots)
    return EmulatedEngine(store, slots, link, timeout_s=timeout_s)


def check_setup(config, family: str, device: torch.device, experts_in_memory: bool) -> None:
    """Refuse, before anything is taken, what this model and device cannot run (named, with what to do)."""
    fam = family
    if config.link.name == "disk" and config.store.kind != "ssd":
        raise ValueError(f"{fam}: link='disk' reads experts from the checkpoint's files: set store='ssd' (and "
                         "checkpoint=<the folder the model was loaded from>)")
    if config.store.kind == "ssd" and experts_in_memory and device.type != "cpu":
        raise ValueError(f"{fam}: store='ssd' with the model's experts in {device.type} memory: close() could "
                         "give them back only by reading the checkpoint again, which may have changed or vanished "
                         "by then. Use store='ram' (a host copy of the caller's experts), or open the checkpoint "
                         "with fate_lab.load_offloaded(path, config), whose experts live only in the file")
    if not experts_in_memory:
        if is_scaled(config.link.name) and config.link.layer_compute_s is None:
            raise ValueError(f"link={config.link.name!r} is scaled to this machine's layer time, which cannot be "
                             "measured on a model whose experts were never loaded (load_offloaded): give "
                             "OffloadConfig(layer_compute_s=...) or an unscaled link")
        if config.cache.allocation == "miss_curve" and config.cache.miss_curves is None:
            raise ValueError("allocation='miss_curve' calibrates on a run of the plain model, which a model whose "
                             "experts were never loaded (load_offloaded) cannot do: give OffloadConfig("
                             "miss_curves=...) or another allocation")
