"""Bad inputs across quant.py and trace.py: the error's type, and a message naming the argument, the value
and what is allowed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fate_lab.model.trace import Trace, from_routing_array
from fate_lab.quant import QuantSpec, packed_nbytes, quantize

OK = [[[0, 1], [2, 3]], [[1, 0], [3, 2]]]  # 2 tokens, 2 layers, k = 2, ids < 4


def _nan_row() -> torch.Tensor:
    w = torch.zeros(1, 64)
    w[0, 9] = float("nan")
    return w


def _trace_with_phase(phase: list[int]) -> Trace:
    z = torch.zeros(len(phase), dtype=torch.int64)
    return Trace(experts=torch.zeros(len(phase), 1, 1, dtype=torch.int64), token_ids=z, phase=torch.tensor(phase),
                 prompt_id=z, position=z)


# (call, error, fragments the message must hold: the argument, the value, what is allowed)
CASES = {
    "bits_float": (lambda: QuantSpec(4.0, 64), TypeError, ("bits", "4.0", "(2, 3, 4, 8)")),
    "bits_unsupported": (lambda: QuantSpec(5, 64), ValueError, ("bits", "5", "(2, 3, 4, 8)")),
    "group_zero": (lambda: QuantSpec(4, 0), ValueError, ("group_size", "0", "positive int")),
    "group_float": (lambda: QuantSpec(4, 16.0), TypeError, ("group_size", "16.0", "positive int")),
    "refine_str": (lambda: QuantSpec(4, 64, refine="yes"), TypeError, ("refine", "'yes'", "True or False")),
    "packed_bits_float": (lambda: packed_nbytes(10, 3.0), TypeError, ("bits", "3.0", "(2, 3, 4, 8)")),
    "quantize_nan": (lambda: quantize(_nan_row(), QuantSpec(4, 64), name="gate"), ValueError,
                     ("'gate'", "1 of 64", "finite")),
    "quantize_bool": (lambda: quantize(torch.ones(1, 64, dtype=torch.bool), QuantSpec(4, 64)), TypeError,
                      ("quantize", "torch.bool", "floating-point")),
    "quantize_int": (lambda: quantize(torch.ones(1, 64, dtype=torch.int32), QuantSpec(4, 64)), TypeError,
                     ("torch.int32", "floating-point")),
    "quantize_numpy": (lambda: quantize(np.ones((1, 64), dtype=np.float32), QuantSpec(4, 64)), TypeError,
                       ("torch.Tensor", "ndarray", "torch.from_numpy")),
    "quantize_huge": (lambda: quantize(torch.full((1, 64), 1e5), QuantSpec(4, 64), name="gate"), ValueError,
                      ("'gate'", "100000", "65504")),
    "routing_float": (lambda: from_routing_array(torch.tensor(OK, dtype=torch.float64), num_experts=4), TypeError,
                      ("routing", "float64", "integer expert ids")),
    "routing_id_too_large": (lambda: from_routing_array([[[0, 5]]], num_experts=4), ValueError,
                             ("expert ids", "5", "[0, num_experts=4)")),
    "num_experts_negative": (lambda: from_routing_array(OK, num_experts=-2), ValueError,
                             ("num_experts", "-2", "positive int")),
    "phase_value": (lambda: from_routing_array(OK, num_experts=4, phase=[0, 5]), ValueError,
                    ("phase", "5", "0 (prefill) or 1 (decode)")),
    "phase_name": (lambda: from_routing_array(OK, num_experts=4, phase="Prefil"), ValueError,
                   ("phase", "'Prefil'", "'prefill', 'decode'")),
    "lengths_sum": (lambda: from_routing_array(OK, num_experts=4, lengths=[1, 1, 1]), ValueError,
                    ("lengths", "sum 3", "2 tokens")),
    "prompt_id_shape": (lambda: from_routing_array(OK, num_experts=4, prompt_id=[0, 0, 1]), ValueError,
                        ("prompt_id", "(3,)", "(2,)")),
    "trace_phase": (lambda: _trace_with_phase([0, 9]), ValueError, ("Trace.phase", "9", "0 (prefill) or 1 (decode)")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_error_names_argument_value_and_allowed(case):
    call, error, fragments = CASES[case]
    with pytest.raises(error) as e:
        call()
    message = str(e.value)
    missing = [f for f in fragments if f not in message]
    assert not missing, f"{case}: message {message!r} lacks {missing}"
