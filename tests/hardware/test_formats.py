"""Weight formats: GGML's bits from its block sizes, llama.cpp's _M mixes by layer, and whole files against the
sizes llama.cpp itself prints for published GGUFs."""
import pytest

from fate_lab.hardware.formats import FORMATS, TYPES, Rule, WeightFormat, weight_format
from fate_lab.study.plan_model import model_spec

GIB = 2**30


@pytest.mark.parametrize("name,block_bytes,weights", [("Q4_K", 144, 256), ("Q6_K", 210, 256), ("Q8_0", 34, 32),
                                                      ("Q2_K", 84, 256), ("MXFP4", 17, 32), ("Q4_0", 18, 32)])
def test_ggml_bits_are_block_bytes_over_block_weights(name, block_bytes, weights):
    assert TYPES[name] == pytest.approx(8 * block_bytes / weights)


def test_q4_k_m_gives_ffn_down_six_bits_in_llama_cpps_more_bits_layers():
    f = FORMATS["q4_k_m"]
    # use_more_bits(i, 48): i < 6, i >= 42, or (i - 6) % 3 == 2 -> layers 0-5, 8, 11, ..., 41, 42-47
    more = [i for i in range(48) if f.type_of("exps_down", i, 48, 128) == "Q6_K"]
    assert more == list(range(6)) + list(range(8, 42, 3)) + list(range(42, 48))
    assert f.type_of("exps_gate_up", 7, 48, 128) == "Q4_K" and f.type_of("head") == "Q6_K"
    assert f.type_of("router") == "F32" and f.type_of("norm") == "F32"  # never quantized


def test_an_eight_expert_model_keeps_attention_v_and_k_at_q8_0():
    f = FORMATS["q4_k_m"]
    assert f.type_of("attn_v", 3, 32, 8) == "Q8_0" and f.type_of("attn_k", 3, 32, 8) == "Q8_0"
    assert f.type_of("attn_o", 3, 32, 8) == "Q5_K" and f.type_of("attn_k", 3, 32, 128) == "Q4_K"


@pytest.mark.parametrize("model,fmt,gib", [
    ("gpt-oss-20b", "mxfp4_moe", 11.27),  # llama-bench: "gpt-oss 20B MXFP4 MoE | 11.27 GiB" (llama.cpp PR 16991)
    ("Qwen3-30B-A3B", "q4_k_m", 17.34),  # llama-bench: "qwen3moe 30B.A3B Q4_K - Medium | 17.34 GiB"
])
def test_a_whole_file_matches_the_size_llama_cpp_prints(model, fmt, gib):
    p = model_spec(model).params
    assert p.total_bytes(FORMATS[fmt]) / GIB == pytest.approx(gib, rel=0.01)


def test_a_config_declares_its_format_and_experts_can_be_overridden():
    assert model_spec("gpt-oss-120b").declared == "mxfp4" and model_spec("DeepSeek-V3").declared == "fp8"
    assert model_spec("Qwen3-30B-A3B").declared is None
    mixed = FORMATS["bf16"].with_experts(FORMATS["q4_k_m"])
    assert mixed.type_of("attn_q") == "BF16" and mixed.type_of("exps_gate_up", 5, 48, 128) == "Q4_K"
    assert mixed.expert_quantized() and not FORMATS["bf16"].expert_quantized()


def test_bad_format_and_rule_names_are_one_clear_line():
    with pytest.raises(ValueError, match=r"--expert-weights 'q5_foo': unknown weight format; choose one of bf16"):
        weight_format("q5_foo", "--expert-weights")
    with pytest.raises(ValueError, match="classes from"):
        Rule(("attention",), "Q4_K")
    with pytest.raises(ValueError, match="tensor class 'mlp'"):
        WeightFormat("x", "Q4_K").type_of("mlp")


def test_a_remembered_build_equals_a_fresh_one(tmp_path, monkeypatch):
    import torch

    from fate_lab.study import plan_model

    monkeypatch.setenv("FATE_LAB_CACHE", str(tmp_path))
    fresh = plan_model._build(str((plan_model.CONFIGS_DIR / "gpt-oss-20b" / "config.json").resolve()), torch.bfloat16)
    first = plan_model.model_spec("gpt-oss-20b")  # builds, writes the cache
    assert len(list(tmp_path.glob("*.json"))) == 1
    again = plan_model.model_spec("gpt-oss-20b")  # read back
    assert (again.shape, again.params, again.vocab_size, again.tied, again.declared) == fresh
    assert first.params == again.params
