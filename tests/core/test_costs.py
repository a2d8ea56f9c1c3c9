"""Model costs read off a shape, checked against the published model built on the meta device."""
import pytest
import torch

from fate_lab.core.costs import compute_for, model_costs
from fate_lab.core.shape import ModelShape
from fate_lab.hardware.devices import DEVICES
from fate_lab.hardware.models import PUBLISHED_COSTS


def test_the_published_qwen_costs_equal_its_config_built_on_the_meta_device():
    from fate_lab.model.adapters import adapt
    from fate_lab.study.memory import meta_model

    m = meta_model("Qwen1.5-MoE-A2.7B")  # fp32 on meta: the fp16 setups halve its bytes
    a = adapt(m)
    shape = ModelShape(len(m.model.layers), a.num_moe_layers, a.num_experts, a.top_k, a.hidden_size,
                       a.expert_intermediate_size, torch.float16, a.dense_bytes() // 2, a.kv_bytes_per_token() // 2)
    c, ref = model_costs(shape, vocab_size=151936), PUBLISHED_COSTS["Qwen1.5-MoE-A2.7B"]
    assert c.dense_layer_bytes == pytest.approx(ref.dense_layer_bytes, rel=1e-9)
    assert (c.expert_bytes, c.head_bytes, c.router_host_bytes, c.num_layers) == \
        (ref.expert_bytes, ref.head_bytes, ref.router_host_bytes, ref.num_layers)


def test_costs_of_a_hand_shape():
    shape = ModelShape(4, 3, 8, 2, 64, 32, torch.float32, dense_bytes=4 * 1000 + 2 * 100 * 64 * 4,
                       kv_bytes_per_token=4 * 256)
    c = model_costs(shape, vocab_size=100, context=10)
    assert c.head_bytes == 100 * 64 * 4 and c.dense_layer_bytes == 1000  # embeddings and head taken off first
    assert c.expert_bytes == 3 * 64 * 32 * 4 and c.expert_flops == 2 * 3 * 64 * 32
    assert c.kv_layer_bytes == 256 * 10 and c.router_host_bytes == 4 * 8 * 64
    tied = model_costs(shape, vocab_size=100, tied=True)
    assert tied.dense_layer_bytes == 1000 + 100 * 64 * 4 / 4  # a tied head is the embedding: taken off once
    prof = compute_for(shape, "rtx4090")
    d = DEVICES["rtx4090"]
    assert prof.expert_s == pytest.approx(4 * d.launch_s + c.expert_bytes / (d.mem_bandwidth * d.bw_efficiency))
