"""Groupwise weight-only quantization of expert weights (8/4/3/2 bits) and Fate's INT4/INT2 scheme.

`kernels` (pure tensor functions and byte counts), `experts` (one expert of any layout packed, biases
beside it), `policy` (`QuantPolicy`: which precision an expert
rests or travels at) and `surgery` (quality of quantized experts without the runtime). The names below
are the package's public surface.
"""
from fate_lab.quant.experts import PackedExpert, pack_expert
from fate_lab.quant.kernels import (
    REASONS,
    SUPPORTED_BITS,
    QuantizedTensor,
    QuantSpec,
    expert_nbytes,
    pack,
    packed_nbytes,
    quantize,
    quantize_expert,
    quantized_nbytes,
    reconstruction_error,
    unpack,
)
from fate_lab.quant.policy import QuantPolicy
from fate_lab.quant.surgery import quality_report, quantize_model_experts

__all__ = ["REASONS", "SUPPORTED_BITS", "PackedExpert", "QuantPolicy", "QuantSpec", "QuantizedTensor",
           "expert_nbytes", "pack", "pack_expert", "packed_nbytes", "quality_report", "quantize", "quantize_expert",
           "quantize_model_experts", "quantized_nbytes", "reconstruction_error", "unpack"]
