"""Experts computed on the host: the placement rule by hand, exact tokens, and runtime == simulator.

The host path must not change a token: it computes the same expert from the store's weights
(on a CPU, the very tensors the model had). Counts of host calls must agree between the runtime
and the simulator like every other counter (tests/sim/test_parity.py runs the static placements;
here a deterministic rule stands in for the cost model so the instant link can compare them).
"""

import pytest
import torch
from helpers import greedy, prompt_ids

from fate_lab.core.config import OffloadConfig
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.hosts import HostProfile
from fate_lab.hardware.profiles import COMPUTE_PROFILES
from fate_lab.hardware.setups import Hardware
from fate_lab.model.adapters import adapt
from fate_lab.model.record import record_trace
from fate_lab.model.testing import tiny_model
from fate_lab.offloading.runtime import offload
from fate_lab.paths import EMBEDDED_MODELS
from fate_lab.policy.placement import HostPlacement, host_layer_set
from fate_lab.sim.simulate import simulate


def test_host_profile_time_by_hand():
    p = HostProfile("h", bandwidth=1e9, flops=1e12, call_s=1e-5)
    # 1 MB at 1 GB/s = 1 ms dominates 1 token x 1 MFLOP at 1 TFLOP/s = 1 us
    assert p.expert_s(1_000_000, 1e6, 1) == pytest.approx(1e-5 + 1e-3)
    # 5000 tokens x 1 MFLOP = 5 GFLOP at 1 TFLOP/s = 5 ms > 1 ms of reading
    assert p.expert_s(1_000_000, 1e6, 5000) == pytest.approx(1e-5 + 5e-3)


def test_placement_rule_by_hand():
    host_s = lambda n: 1e-4 * n  # noqa: E731 - 0.1 ms per token
    cost = HostPlacement("cost", frozenset(), host_s, transfer_s=3.5e-4)
    assert [cost.on_host(0, n) for n in (1, 2, 3, 4, 10)] == [True, True, True, False, False]
    assert not cost.layer_on_host(0)
    layers = HostPlacement("layers", host_layer_set("layers", 2, 8), host_s, transfer_s=3.5e-4)
    assert [layers.on_host(m, 100) for m in range(4)] == [True, True, False, False]
    assert host_layer_set("layers", -1, 3) == {0, 1, 2} and host_layer_set("cost", 5, 8) == frozenset()
    assert host_layer_set("layers", 10, 3) == {0, 1, 2}
    with pytest.raises(ValueError, match="mode"):
        HostPlacement("gpu", frozenset(), host_s, 0.0)


def test_config_refuses_bad_host_settings():
    with pytest.raises(ValueError, match="host"):
        OffloadConfig(host="cpu")
    with pytest.raises(ValueError, match="host_layers > 0"):
        OffloadConfig(host="layers")
    with pytest.raises(ValueError, match="host_profile"):
        OffloadConfig(host="cost", host_profile="abacus")
    with pytest.raises(ValueError, match="quant"):
        OffloadConfig.preset("host_compute", quant="fate")
    with pytest.raises(ValueError, match="host_layers"):
        OffloadConfig(host="layers", host_layers=-3)


def _models():
    out = [("olmoe", tiny_model("olmoe", seed=1))]
    from fate_lab.model.models import load_model

    for name, folder in EMBEDDED_MODELS.items():
        if (folder / "model.safetensors").is_file():
            out.append((name, load_model(name)[0]))
    return out


@pytest.mark.parametrize("name,cfg", [
    # an NVMe link moves a tiny expert in >= 0.1 ms; the desktop host takes ~0.04 ms for a decode token:
    # every decode miss goes to the host, prefill steps with many tokens per expert load it
    ("host_compute", OffloadConfig.preset("host_compute", slots=16, link="nvme")),
    ("static_host", OffloadConfig.preset("static_host", slots=16, link="instant")),
    ("all_host", OffloadConfig.preset("all_host", link="instant")),
])
def test_host_compute_keeps_greedy_tokens_exactly(name, cfg):
    """Same tokens as the plain model; the same logits, bit for bit, as the runtime computing every expert on
    the device (HF's own fused expert loop sums in another order: 1e-4 against it, as in test_runtime)."""
    for family, model in _models():
        ids = prompt_ids(model.config.vocab_size, n=12)
        ref, ref_scores = greedy(model, ids, 10)
        with offload(model, cfg.replace(host=None, host_layers=0)) as rt:
            _, device_scores = greedy(model, ids, 10)
        with offload(model, cfg) as rt:
            out, scores = greedy(model, ids, 10)
            s = rt.stats.summary()
        assert torch.equal(out, ref), (name, family)
        torch.testing.assert_close(scores, ref_scores, rtol=1e-4, atol=1e-4)
        assert torch.equal(scores, device_scores), (name, family)
        assert s["decode"]["host"] > 0, (name, family)
        assert s["decode"]["host"] <= s["decode"]["misses"]
        if name == "all_host":  # nothing lives on the device, nothing moves
            assert s["decode"]["bytes_moved"] == 0 and s["prefill"]["bytes_moved"] == 0
            assert s["decode"]["host"] == s["decode"]["uses"]
            assert sum(rt.slots_per_layer) == 0
        if name == "static_host":  # layers 0 and 1 hold no slots and compute every expert on the host
            M = len(rt.slots_per_layer)
            assert rt.slots_per_layer[:2] == [0, 0] and sum(rt.slots_per_layer) == (16 if M > 2 else 0)
            for m in range(min(2, M)):
                d = rt.stats.layers[m]["decode"]
                assert d.host == d.uses and d.bytes_moved == 0 and d.prefetch_issued == 0


def test_cost_rule_runtime_equals_simulator(monkeypatch, tiny_models):
    """With a deterministic stand-in for the cost rule (host for experts used by one token of the step),
    the runtime and the simulator make the same host calls, hits and transfers on an instant link."""
    monkeypatch.setattr(HostPlacement, "on_host", lambda self, m, n: n == 1)
    model = tiny_models("olmoe", seed=2)
    prompts = [prompt_ids(model.config.vocab_size, n=10, seed=s)[0].tolist() for s in (0, 1)]
    trace = record_trace(model, None, prompts, decode_tokens=6, progress=False)
    shape = ModelShape.from_adapter(adapt(model))
    keys = ("uses", "hits", "misses", "host", "late", "prefetch_issued", "bytes_moved")
    for preset in ("host_compute", "static_host"):
        cfg = OffloadConfig.preset(preset, link="instant", slots=8)
        with offload(model, cfg) as rt:
            for p in prompts:
                greedy(model, torch.tensor([p]), 7)
            real = [{(ph, k): getattr(l[ph], k) for ph in l for k in keys} for l in rt.stats.layers]
        sim = simulate(trace, cfg, Hardware(COMPUTE_PROFILES["qwen15_moe_rtx3090"], None), shape)
        simc = [{(ph, k): getattr(l[ph], k) for ph in l for k in keys} for l in sim.layers]
        assert real == simc, preset
        assert sum(l["decode"].host for l in sim.layers) > 0


def test_simulated_host_compute_beats_loading_on_a_slow_link(tiny_models):
    """On the scaled PCIe 3.0 setup with a desktop host, a decode miss costs ~1 layer time on the host
    against ~3 over the link: the simulator must predict host_compute faster than fate at 25% cached."""
    model = tiny_models("olmoe", seed=3)
    prompts = [prompt_ids(model.config.vocab_size, n=12, seed=s)[0].tolist() for s in range(3)]
    trace = record_trace(model, None, prompts, decode_tokens=16, progress=False)
    shape = ModelShape.from_adapter(adapt(model))
    hw = Hardware.scaled("qwen15_moe_rtx3090_pcie3")
    slots = shape.num_moe_layers * shape.num_experts // 4
    fate = simulate(trace, OffloadConfig.preset("fate", slots=slots), hw, shape)
    host = simulate(trace, OffloadConfig.preset("host_compute", slots=slots), hw, shape)
    assert host.summary()["decode"]["host"] > 0
    assert host.decode_tok_s > fate.decode_tok_s
