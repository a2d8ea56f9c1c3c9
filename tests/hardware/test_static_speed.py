"""The static speed model: a hand example, llama.cpp's placement rule, memory fit, and the bounds that physics sets."""
import dataclasses

import pytest

from fate_lab.hardware.devices import DEVICES, DeviceSpec
from fate_lab.hardware.disks import Disk
from fate_lab.hardware.engines import ENGINES, Engine
from fate_lab.hardware.formats import FORMATS
from fate_lab.hardware.host_specs import HostSpec
from fate_lab.hardware.links import LinkProfile
from fate_lab.hardware.params import LayerParams, ModelParams
from fate_lab.hardware.placements import ALL, Placement
from fate_lab.hardware.static_speed import Deployment, mmap_read_bytes, predict

LAYER = LayerParams((("attn_q", 1000),), experts=4, expert_gate_up=200, expert_down=100)
TOY = ModelParams("toy", (LAYER, LAYER), embed=500, head=500, other=0, top_k=2, hidden=10)
DEV = DeviceSpec("toy gpu", 1e9, 1e12, 1.0, "pcie4_x16")  # 0.75 of 1 GB/s reached
HOST = HostSpec("toy host", "ddr4", 1000, 1, cores=1)  # 8 GB/s peak
ENG = Engine("toy", cpu_bw_eff=0.5, cpu_core_bps=1e12, numa_gain=0.0, layer_s=1e-6, hop_s=2e-6, cpu_flops_eff=0.5,
             prefill_stream=False)
LINK = LinkProfile("toy link", 1e9, 0.0)


def _toy(placement: Placement, **kw) -> Deployment:
    return Deployment(TOY, FORMATS["bf16"], placement, DEV, HOST, ENG, LINK, **kw)


def test_a_decode_token_by_hand():
    gbw, cbw = 0.75e9, 0.5 * 8e9
    # all on the GPU: per layer 1000 attention + 2 experts x 300 weights at 2 bytes, then the head
    r = predict(_toy(Placement()))
    assert 1 / r.decode_tok_s == pytest.approx(2 * ((2000 + 1200) / gbw + 1e-6) + 1000 / gbw)
    # --cpu-moe: the experts' bytes at the engine's CPU bandwidth, plus a hop per layer
    r = predict(_toy(Placement(cpu_moe=True)))
    assert 1 / r.decode_tok_s == pytest.approx(2 * (2000 / gbw + 1e-6 + 2e-6) + 1000 / gbw + 2400 / cbw)
    assert r.flags == "-ngl 999 --cpu-moe" and r.fits


def test_a_measured_host_time_scales_with_the_host_clock():
    # an engine whose per-layer time is host time measured on a 2.6 GHz core: on a 5.2 GHz host it is half, on a
    # 1.3 GHz host twice (the host's all-core clock, HostSpec.ghz); a fixed per-layer time stays as it is
    measured = dataclasses.replace(ENG, layer_s=10e-6, layer_s_ghz=2.6)
    fast, slow = dataclasses.replace(HOST, ghz=5.2), dataclasses.replace(HOST, ghz=1.3)
    gpu = 2 * (2000 + 1200) / 0.75e9 + 1000 / 0.75e9  # all on the GPU, as in the test above
    for host, layer in ((fast, 5e-6), (slow, 20e-6)):
        r = predict(Deployment(TOY, FORMATS["bf16"], Placement(), DEV, host, measured, LINK))
        assert 1 / r.decode_tok_s == pytest.approx(gpu + 2 * layer)
        r = predict(Deployment(TOY, FORMATS["bf16"], Placement(), DEV, host, ENG, LINK))
        assert 1 / r.decode_tok_s == pytest.approx(gpu + 2 * 1e-6)
    assert ENGINES["fate_lab"].layer_time(5.2) == pytest.approx(ENGINES["fate_lab"].layer_s / 2)
    with pytest.raises(ValueError, match="ghz"):
        ENGINES["fate_lab"].layer_time(0.0)


def test_weights_beyond_ram_stream_from_disk_in_read_ahead_windows():
    disk = Disk("toy disk", 1e9, 1e-4, queue_depth=4, readahead=8192)
    host = dataclasses.replace(HOST, ram_gib=1.0)  # 1 GiB minus the OS's 2 GiB: nothing resident
    r = predict(dataclasses.replace(_toy(Placement(cpu_moe=True), disk=disk), host=host))
    # 2 layers x top-2 experts of 600 bytes, each smaller than a window: a whole 8 KiB window read per expert,
    # one core faulting one window at a time
    window = 8192 / (1e-4 + 8192 / 1e9)
    assert r.resident_share == 0 and r.parts_ms["disk"] == pytest.approx(1e3 * 4 * 8192 / window)
    assert r.decode_bound == "disk reads"
    no_disk = predict(dataclasses.replace(_toy(Placement(cpu_moe=True)), host=host))
    assert not no_disk.fits and no_disk.decode_tok_s is None and "no --disk" in no_disk.why


def test_a_fault_reads_the_window_around_it():
    # a run larger than the window: its bytes and the half window before its start (the read-around is centred
    # on the first fault); a run smaller than the window: the whole window
    assert mmap_read_bytes(1_000_000, 128 << 10) == 1_000_000 + (64 << 10)
    assert mmap_read_bytes(3000, 128 << 10) == 128 << 10
    # the same weights with larger windows: fewer, larger reads, so a latency-bound disk streams them faster
    host = dataclasses.replace(HOST, ram_gib=1.0)
    big = LayerParams((("attn_q", 1000),), experts=4, expert_gate_up=2_000_000, expert_down=1_000_000)
    model = ModelParams("big", (big, big), embed=500, head=500, other=0, top_k=2, hidden=10)
    parts = [predict(Deployment(model, FORMATS["bf16"], Placement(cpu_moe=True), DEV, host, ENG, LINK,
                                disk=Disk("d", 1e9, 1e-3, readahead=ra))).parts_ms["disk"]
             for ra in (4096, 128 << 10, 8 << 20)]
    assert parts[0] > parts[1] > parts[2]


def test_llama_cpp_placement_rule():
    assert Placement(2).layout(4).layers == ((False, False), (False, False), (True, True), (True, True))
    assert not Placement(4).layout(4).head_on_gpu and Placement(5).layout(4).head_on_gpu
    assert Placement(ALL, 3).layout(4).layers == ((True, False),) * 3 + ((True, True),)
    assert Placement(ALL, 2).flags(4) == "-ngl 999 --n-cpu-moe 2" and Placement(ALL, 4).flags(4) == "-ngl 999 --cpu-moe"
    assert Placement(0).flags() == "-ngl 0" and Placement(0).cpu_only
    with pytest.raises(ValueError, match="--n-cpu-moe -1"):
        Placement(ALL, -1)


def test_a_deployment_that_does_not_fit_is_never_a_speed():
    r = predict(_toy(Placement(), budget_bytes=100.0))
    assert not r.fits and r.decode_tok_s is None and r.prefill_tok_s is None and "GiB of device memory" in r.why


@pytest.mark.parametrize("model,fmt,dev,n", [("Qwen3-30B-A3B", "q4_k_m", "rtx3060", 20),
                                             ("gpt-oss-120b", "mxfp4_moe", "rtx3090", 27),
                                             ("DeepSeek-V3", "q4_k_m", "rtx4090", 61)])
def test_no_prediction_beats_the_bytes_over_peak_bandwidth_bound(model, fmt, dev, n):
    from fate_lab.hardware.host_specs import HOSTS
    from fate_lab.study.plan_model import model_spec

    p, f, d = model_spec(model).params, FORMATS[fmt], DEVICES[dev]
    host = HOSTS["epyc_7773x"]
    r = predict(Deployment(p, f, Placement(ALL, n), d, host, ENGINES["llama.cpp"], LinkProfile("l", 25e9, 0.0)))
    lay = Placement(ALL, n).layout(p.n_layers).layers
    gpu = sum(p.dense_bytes(f, i) + (p.top_k * p.expert_bytes(f, i) if e else 0) for i, (_, e) in enumerate(lay))
    cpu = sum(p.top_k * p.expert_bytes(f, i) for i, (_, e) in enumerate(lay) if not e and p.layers[i].experts)
    bound = gpu / d.mem_bandwidth + cpu / host.socket_bandwidth()  # data-sheet peaks, no overheads
    assert r.decode_tok_s < 1 / bound
    more_cpu = predict(Deployment(p, f, Placement(ALL, max(0, n - 1)), d, host, ENGINES["llama.cpp"], None))
    assert more_cpu.gpu_bytes > r.gpu_bytes  # one layer's experts fewer on the CPU: more device memory
