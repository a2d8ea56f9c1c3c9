"""ModelShape: what every driver knows of a model, from a live model or from its config alone (meta device),
for every experts-interface family; its bytes per expert are the layout's, biases and gate-less rows included."""
import dataclasses
import math
import time

import pytest
import torch
from transformers import MixtralConfig

from fate_lab.core.shape import ModelShape
from fate_lab.core.sizing import layout_bytes
from fate_lab.model.adapters import adapt
from fate_lab.model.families import experts_interface_families
from fate_lab.model.testing import tiny_model
from fate_lab.quant import QuantSpec, pack_expert


@pytest.mark.parametrize("family", experts_interface_families())
def test_from_config_equals_the_live_model_for_every_family(family, tmp_path):
    model = tiny_model(family)
    a = adapt(model)
    live = ModelShape.from_adapter(a)
    model.config.save_pretrained(tmp_path)
    for source in (tmp_path, tmp_path / "config.json", model.config):
        assert dataclasses.replace(ModelShape.from_config(source), source="") == dataclasses.replace(live, source="")
    assert live.nbytes(None) == a.bytes_per_expert() == a.layouts[0].bytes_per_expert()
    assert live.expert_shapes()["gate_up"] == (a.layouts[0].rows, a.layouts[0].hidden_size)


def test_biases_travel_beside_packed_weights_and_every_count_agrees(tiny_models):
    """gpt-oss: ModelShape.nbytes at a spec == a packed expert's bytes (biases at full precision), and the packed
    slot layout holds the biases' aligned bytes on top of the weights'."""
    model = tiny_models("gpt_oss", seed=0, intermediate_size=64)
    a = adapt(model)
    shape = ModelShape.from_adapter(a)
    spec = QuantSpec(4, 64)
    packed = pack_expert(a.expert(0, 3), spec)
    assert shape.nbytes(spec) == packed.nbytes
    biases = {n: v for n, v in shape.expert_shapes().items() if n.endswith("_bias")}
    assert set(biases) == {"gate_up_bias", "down_bias"}
    bias_bytes = sum(-(-math.prod(v) * 4 // 8) * 8 for v in biases.values())  # fp32, 8-byte aligned segments
    no_bias = {n: v for n, v in shape.expert_shapes().items() if not n.endswith("_bias")}
    assert (layout_bytes(shape.expert_shapes(), spec, torch.float32)
            == layout_bytes(no_bias, spec, torch.float32) + bias_bytes)


def test_a_gateless_family_counts_i_rows():
    a = adapt(tiny_model("nemotron_h"))
    shape = ModelShape.from_adapter(a)
    H, I = shape.hidden, shape.intermediate
    assert not shape.gated and shape.expert_shapes() == {"gate_up": (I, H), "down": (H, I)}
    assert shape.nbytes(None) == 2 * H * I * 4 and shape.expert_flops() == 2.0 * 2 * H * I


def test_from_config_builds_no_weights_for_a_real_size_model():
    """Mixtral-8x7B's published sizes (46.7B parameters, bf16): the shape comes in seconds without its 93 GB."""
    cfg = MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                        dtype="bfloat16")
    t0 = time.perf_counter()
    shape = ModelShape.from_config(cfg)
    assert time.perf_counter() - t0 < 60
    assert (shape.num_moe_layers, shape.num_experts, shape.top_k, shape.dtype) == (32, 8, 2, torch.bfloat16)
    assert shape.nbytes(None) == 3 * 4096 * 14336 * 2  # one expert: 352 MB
    assert shape.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2


def test_from_config_refuses_what_is_not_a_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        ModelShape.from_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ModelShape.from_config(tmp_path / "nope.json")
