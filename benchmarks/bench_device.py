"""The first thing a GPU owner runs: every preset on the real PCIe link of a CUDA device, one table.

Loads the embedded model onto the GPU, times plain greedy `generate`, then every preset with
`native_link=True` (a CUDA copy stream moving pinned host memory over the machine's own PCIe
link) at half and a quarter of the experts cached, and checks the tokens equal plain generate's
(lossless presets) -- the CUDA path's correctness and its speed in one run. Also runs the
emulated scaled PCIe 3.0 link on the GPU for comparison with the CPU tables. Beside each measured row: the
timed simulator's prediction for the same config, on a trace of the same prompt, with this GPU's compute
profile calibrated from the runtime (`fit.calibrate.calibrate_compute`) and the link's profile (the native
link's is the device catalogue's host link, e.g. PCIe 5.0 x16 for an H200: an assumption the ratio tests).

    python -m benchmarks.bench_device            # needs CUDA; `benchmarks/device_check.sh` calls it
"""
from __future__ import annotations

import argparse
import time

import torch

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.fit.calibrate import calibrate_compute
from fate_lab.hardware.devices import DEVICES
from fate_lab.hardware.links import LINK_PROFILES
from fate_lab.hardware.setups import Hardware, run_hardware
from fate_lab.model.adapters import adapt
from fate_lab.model.record import record_trace
from fate_lab.offloading.runtime import calibrate_layer_time, offload
from fate_lab.sim.simulate import simulate


def _native_link(name: str) -> str:
    """The catalogue's host link of the GPU named `name` (PCIe 4.0 x16 when it is not catalogued)."""
    low = name.lower()
    for dev in DEVICES.values():
        if dev.name.lower().split(" ")[-1] in low or dev.name.lower() in low:
            return dev.host_link if dev.host_link in LINK_PROFILES else "pcie4_x16"
    return "pcie4_x16"


def _generate(model, ids, n):
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    torch.cuda.synchronize()
    return out


def _timed(model, ids, n) -> tuple[torch.Tensor, float]:
    """Tokens and decode tok/s (from the forward hook times: TTFT excluded)."""
    ends: list[float] = []
    def stamp(*_) -> None:  # a forward hook that returns anything but None replaces the model's output
        torch.cuda.synchronize()
        ends.append(time.perf_counter())

    h = model.register_forward_hook(stamp)
    try:
        out = _generate(model, ids, n)
    finally:
        h.remove()
    return out, (len(ends) - 1) / (ends[-1] - ends[0])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens generated per run (default %(default)s)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_device needs a CUDA device (torch.cuda.is_available() is False)")
    from fate_lab.model.models import load_model

    model, tok = load_model(None, device="cuda")
    a = adapt(model)
    ids = tok("The expert cache holds the experts that", return_tensors="pt")["input_ids"].to("cuda")
    _generate(model, ids, 4)
    plain, plain_tps = _timed(model, ids, args.new_tokens)
    layer_s = calibrate_layer_time(model, steps=24)
    gpu = torch.cuda.get_device_name()
    native_profile = _native_link(gpu)
    compute = calibrate_compute(model, ids, name=gpu)  # this GPU's compute profile, from the runtime itself
    trace = record_trace(model, None, [ids[0].tolist()], decode_tokens=args.new_tokens - 1, progress=False)
    shape = ModelShape.from_adapter(a)
    print(f"{gpu}; torch {torch.__version__}; layer time {layer_s * 1e3:.3f} ms; plain generate {plain_tps:.1f} "
          f"tok/s; native link assumed {native_profile} for the prediction\n")
    head = ["link", "cached", "preset", "decode tok/s", "vs plain", "decode hit", "stall ms/tok", "MiB moved/tok",
            "tokens == plain", "predicted tok/s", "predicted / measured"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    total = a.num_moe_layers * a.num_experts
    for link, native in (("pcie4_x16", True), ("qwen15_moe_rtx3090_pcie3", False)):
        for share in (0.5, 0.25):
            for name in OffloadConfig.preset_names(include_quant=True):
                cfg = OffloadConfig.preset(name, link=link, native_link=native, slots=int(total * share),
                                           layer_compute_s=layer_s)
                try:
                    with offload(model, cfg) as rt:
                        _generate(model, ids, 4)
                        rt.reset_stats()
                        out, tps = _timed(model, ids, args.new_tokens)
                        s = rt.stats.summary()["decode"]
                    n = max(1, s["forwards"])
                    same = "yes" if torch.equal(out, plain) else ("differs (quantized)" if "quant" in name or
                                                                  "int8" in name else "NO")
                    hw = Hardware(compute, LINK_PROFILES[native_profile]) if native else \
                        run_hardware(link, layer_s, compute)
                    pred = simulate(trace, cfg, hw, shape).decode_tok_s  # quantized: the plain routing, its bytes
                    row = [link + (" (native)" if native else " (emulated)"), f"{share:.0%}", name, f"{tps:.1f}",
                           f"{tps / plain_tps:.2f}", f"{s['hit_rate']:.3f}", f"{1e3 * s['stall_s'] / n:.2f}",
                           f"{s['bytes_moved'] / n / 2**20:.2f}", same, f"{pred:.1f}", f"{pred / tps:.2f}"]
                except Exception as exc:  # one failing preset must not hide the others' rows
                    row = [link, f"{share:.0%}", name, "ERROR", repr(exc)[:80], "", "", "", "", "", ""]
                print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
