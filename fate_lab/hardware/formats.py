"""Weight formats as data: the bits each tensor class of a model takes on disk and in memory, per named format.

What this file is: `TYPES`, the bits per weight of each storage type including its scales (GGML's block types
from their block sizes; the HF formats from their group layouts), `Rule` and `WeightFormat` (a base type plus
ordered per-tensor-class rules, as llama.cpp's `llama_tensor_get_type` picks the `_M` mixes), `FORMATS` (the
catalogue, each with its source) and `weight_format(name)`.

Tensor classes (llama.cpp's categories, on transformers' names): `embed`, `head`, `attn_q`, `attn_k`, `attn_v`
(also MLA's kv_b), `attn_o`, `attn_other` (MLA's q_a/q_b/kv_a), `ffn_gate_up`/`ffn_down` (a dense layer's MLP),
`shexp_gate_up`/`shexp_down` (shared experts), `exps_gate_up`/`exps_down` (routed experts), `exps_bias`,
`router` and `norm` (never quantized: llama.cpp keeps `ffn_gate_inp` and 1-D tensors in F32).
What it is not: a quantizer (`fate_lab/quant/` packs the project's own INT4/INT2) or a speed model
(`static_speed.py` reads these bits).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

CLASSES = ("embed", "head", "attn_q", "attn_k", "attn_v", "attn_o", "attn_other", "ffn_gate_up", "ffn_down",
           "shexp_gate_up", "shexp_down", "exps_gate_up", "exps_down", "exps_bias", "router", "norm")
EXPERT_CLASSES = ("exps_gate_up", "exps_down", "exps_bias")
_KEPT = ("router", "norm", "exps_bias")  # stored as they are, whatever the format

_GGML = "ggml/src/ggml-common.h block structs (bytes per block / weights per block)"
# bits per weight of each storage type, scales and zero points included
TYPES: dict[str, float] = {
    "F32": 32.0, "F16": 16.0, "BF16": 16.0,
    "Q8_0": 34 * 8 / 32,  # block_q8_0: fp16 scale + 32 int8 = 34 bytes / 32
    "Q6_K": 210 * 8 / 256,  # block_q6_K: 128 + 64 + 16 + 2 bytes / 256 = 6.5625
    "Q5_K": 176 * 8 / 256,  # block_q5_K: 2 + 2 + 12 + 32 + 128 bytes / 256 = 5.5
    "Q4_K": 144 * 8 / 256,  # block_q4_K: 2 + 2 + 12 + 128 bytes / 256 = 4.5
    "Q3_K": 110 * 8 / 256,  # block_q3_K: 32 + 64 + 12 + 2 bytes / 256 = 3.4375
    "Q2_K": 84 * 8 / 256,  # block_q2_K: 16 + 64 + 2 + 2 bytes / 256 = 2.625
    "Q4_0": 18 * 8 / 32,  # block_q4_0: fp16 scale + 16 bytes / 32 = 4.5
    "Q4_1": 20 * 8 / 32, "Q5_0": 22 * 8 / 32, "Q5_1": 24 * 8 / 32,
    "MXFP4": 17 * 8 / 32,  # block_mxfp4: one E8M0 scale byte + 16 bytes of FP4 / 32 = 4.25 (OCP MX spec)
    "FP8_B128": 8 + 32 / (128 * 128),  # e4m3 with one fp32 scale per 128x128 block (DeepSeek-V3's config)
    "INT8_ROW": 8 + 16 / 4096,  # int8 with one fp16 scale per output row (4096 weights a row taken)
    "INT4_G128": 4 + (16 + 4) / 128,  # AWQ/GPTQ: int4, one fp16 scale and one packed int4 zero per 128
    "HQQ4_G64": 4 + 16 / 64,  # HQQ 4-bit group 64 with 8-bit quantized scale and zero (quant_scale/quant_zero)
    "HQQ3_G64": 3 + 16 / 64,
    "HQQ2_G16": 2 + 16 / 16,  # mixtral-offloading's experts: 2-bit, group 16, 8-bit scale and zero
    "FATE_INT4": 4 + 32 / 64,  # the project's INT4: group 64, fp16 scale and zero (fate_lab/quant)
    "FATE_INT2": 2 + 32 / 32,  # the project's INT2: group 32, fp16 scale and zero
}
TYPE_SOURCES = {"ggml": _GGML, "FP8_B128": "DeepSeek-V3 config.json quantization_config (fp8 e4m3, block 128x128)",
                "INT4_G128": "AutoAWQ WQLinear_GEMM layout (qweight/qzeros int32-packed, scales fp16, group 128)",
                "HQQ": "mixtral-offloading's notebook: BaseQuantizeConfig(nbits, group_size, quant_zero=True, "
                       "quant_scale=True)", "FATE": "fate_lab/quant (QuantSpec(4, 64), QuantSpec(2, 32))"}

WHEN = ("all", "more_bits", "first_sixteenth", "first_two", "eight_experts", "gqa4")


@dataclass(frozen=True)
class Rule:
    """Tensors of `classes` take `type` where `when` holds (llama.cpp's conditions, by layer and model)."""

    classes: tuple[str, ...]
    type: str
    when: str = "all"

    def __post_init__(self) -> None:
        bad = [c for c in self.classes if c not in CLASSES]
        if bad or self.type not in TYPES or self.when not in WHEN:
            raise ValueError(f"Rule {self}: classes from {CLASSES}, type from {sorted(TYPES)}, when from {WHEN}")

    def holds(self, layer: int, n_layers: int, n_experts: int, gqa: int) -> bool:
        """Whether the rule applies to a tensor of layer `layer` (llama.cpp's use_more_bits etc.)."""
        if self.when == "more_bits":
            return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2
        return {"all": True, "first_sixteenth": layer < n_layers // 16, "first_two": layer < 2,
                "eight_experts": n_experts == 8, "gqa4": gqa >= 4}[self.when]


@dataclass(frozen=True)
class WeightFormat:
    """A named format: the type of every quantizable weight (`base`), per-class rules (first match wins), and
    optionally another format for the routed experts (`--expert-weights`)."""

    name: str
    base: str
    rules: tuple[Rule, ...] = ()
    kept: str = "F32"  # the router, norms and biases
    quantized: bool = True  # False: plain floating point (no dequantize in the kernels)
    source: str = ""
    experts: "WeightFormat | None" = None

    def type_of(self, cls: str, layer: int = 0, n_layers: int = 1, n_experts: int = 0, gqa: int = 1) -> str:
        """The storage type of a tensor of class `cls` in decoder layer `layer` (-1: outside the layers)."""
        if cls not in CLASSES:
            raise ValueError(f"tensor class {cls!r}; choose one of {CLASSES}")
        if self.experts is not None and cls in EXPERT_CLASSES:
            return self.experts.type_of(cls, layer, n_layers, n_experts, gqa)
        if cls in _KEPT:
            return self.kept
        for r in self.rules:
            if cls in r.classes and r.holds(layer, n_layers, n_experts, gqa):
                return r.type
        return self.base

    def bits(self, cls: str, layer: int = 0, n_layers: int = 1, n_experts: int = 0, gqa: int = 1) -> float:
        """Bits per weight of that tensor, scales included."""
        return TYPES[self.type_of(cls, layer, n_layers, n_experts, gqa)]

    def expert_quantized(self) -> bool:
        """Whether the routed experts are stored quantized (their kernels dequantize)."""
        return (self.experts or self).quantized

    def with_experts(self, other: "WeightFormat") -> "WeightFormat":
        """This format with the routed experts stored as `other` stores them."""
        return dataclasses.replace(self, name=f"{self.name}+experts:{other.name}", experts=other)


_QUANT = "llama.cpp src/llama-quant.cpp llama_tensor_get_type_impl (ggml-org/llama.cpp)"
_ATTN_V = ("attn_v",)
_DOWN = ("ffn_down", "shexp_down", "exps_down")  # llama.cpp's FFN_DOWN category covers the three
_LINEAR = tuple(c for c in CLASSES if c not in _KEPT + ("embed", "head"))
_EIGHT = (Rule(("attn_v", "attn_k"), "Q8_0", "eight_experts"),)  # Mixtral-style 8-expert models


def _fp(name: str, t: str, source: str) -> WeightFormat:
    return WeightFormat(name, t, kept=t, quantized=False, source=source)


def _hf(name: str, t: str, source: str, head: str = "BF16") -> WeightFormat:
    """A checkpoint format that quantizes the linear layers and keeps embeddings, head and router in bf16."""
    return WeightFormat(name, head, (Rule(_LINEAR, t),), kept="BF16", source=source)


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    _fp("bf16", "BF16", "bfloat16: 2 bytes a weight"), _fp("fp16", "F16", "IEEE half: 2 bytes a weight"),
    _hf("fp8", "FP8_B128", TYPE_SOURCES["FP8_B128"]),
    _hf("int8", "INT8_ROW", "weight-only int8, one fp16 scale per output row"),
    _hf("int4_awq", "INT4_G128", TYPE_SOURCES["INT4_G128"]), _hf("int4_gptq", "INT4_G128", "GPTQ, group 128 "
                                                                  "(as AWQ's layout; act-order's g_idx left out)"),
    WeightFormat("mxfp4", "BF16", (Rule(("exps_gate_up", "exps_down"), "MXFP4"),), kept="BF16",
                 source="gpt-oss config.json quantization_config (mxfp4 experts; attention, router, embeddings "
                        "and head in bf16)"),
    WeightFormat("mxfp4_moe", "Q8_0", (Rule(("exps_gate_up", "exps_down"), "MXFP4"),), source=f"{_QUANT}: "
                 "LLAMA_FTYPE_MOSTLY_MXFP4_MOE (MoE tensors MXFP4, other tensors and the output Q8_0)"),
    WeightFormat("q8_0", "Q8_0", source=f"{_QUANT}: every quantizable tensor Q8_0, the output too"),
    WeightFormat("q6_k", "Q6_K", _EIGHT, source=_QUANT),
    WeightFormat("q5_k_m", "Q5_K", _EIGHT + (Rule(("head",), "Q6_K"), Rule(_ATTN_V, "Q6_K", "more_bits"),
                                             Rule(_DOWN, "Q6_K", "more_bits")), source=_QUANT),
    WeightFormat("q4_k_m", "Q4_K", _EIGHT + (Rule(("attn_o",), "Q5_K", "eight_experts"), Rule(("head",), "Q6_K"),
                                             Rule(_ATTN_V, "Q6_K", "more_bits"), Rule(_DOWN, "Q6_K", "more_bits")),
                 source=_QUANT),
    WeightFormat("q4_0", "Q4_0", _EIGHT + (Rule(("head",), "Q6_K"),), source=_QUANT),
    WeightFormat("q3_k_m", "Q3_K", _EIGHT + (Rule(("attn_o",), "Q5_K", "eight_experts"), Rule(("head",), "Q6_K"),
                                             Rule(_ATTN_V, "Q5_K", "first_two"), Rule(_ATTN_V, "Q4_K"),
                                             Rule(_DOWN, "Q5_K", "first_sixteenth"), Rule(_DOWN, "Q4_K"),
                                             Rule(("attn_o",), "Q4_K")), source=_QUANT),
    WeightFormat("q2_k", "Q2_K", _EIGHT + (Rule(("attn_o",), "Q5_K", "eight_experts"), Rule(("head",), "Q6_K"),
                                           Rule(_ATTN_V, "Q4_K", "gqa4"), Rule(_ATTN_V, "Q3_K"), Rule(_DOWN, "Q3_K"),
                                           Rule(("attn_o",), "Q3_K")), source=_QUANT),
    WeightFormat("hqq4", "BF16", (Rule(_LINEAR, "HQQ4_G64"),), kept="BF16", source=TYPE_SOURCES["HQQ"]),
    WeightFormat("mixtral_offloading_2bit", "BF16", (Rule(("exps_gate_up", "exps_down"), "HQQ2_G16"),
                                                     Rule(_LINEAR, "HQQ4_G64")), kept="BF16",
                 source=TYPE_SOURCES["HQQ"] + ": attention 4-bit group 64, experts 2-bit group 16"),
    WeightFormat("mixtral_offloading_3bit", "BF16", (Rule(("exps_gate_up", "exps_down"), "HQQ3_G64"),
                                                     Rule(_LINEAR, "HQQ4_G64")), kept="BF16",
                 source="arXiv 2312.17238 Table 1: attention HQQ 4-bit group 64, experts 3-bit group 64"),
    WeightFormat("fate_int4", "BF16", (Rule(("exps_gate_up", "exps_down"), "FATE_INT4"),), kept="BF16",
                 source=TYPE_SOURCES["FATE"]),
    WeightFormat("fate_int2", "BF16", (Rule(("exps_gate_up", "exps_down"), "FATE_INT2"),), kept="BF16",
                 source=TYPE_SOURCES["FATE"]),
)}
# a config's own quantization_config.quant_method -> the format it declares
DECLARED = {"mxfp4": "mxfp4", "fp8": "fp8"}


def weight_format(name: str, flag: str = "--weights") -> WeightFormat:
    """The format named `name` (one clear line naming the flag for an unknown one)."""
    key = str(name).lower()
    if key not in FORMATS:
        raise ValueError(f"{flag} {name!r}: unknown weight format; choose one of {', '.join(FORMATS)}")
    return FORMATS[key]
