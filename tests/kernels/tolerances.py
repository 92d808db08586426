"""Tolerances for comparing attention outputs, shared by the kernel tests.

Outputs are O(1) (softmax-weighted averages of unit-normal V). float32: the kernels and references
differ only in summation order, ~1e-6 observed. bf16: the output is rounded to 8 bits of mantissa
(ulp 2^-7 at 1.0) and the probabilities are rounded to bf16 before the P @ V dot, so a few output
ulps; the interpreter also truncates float32 -> bf16 where the GPU rounds to nearest.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), **TOLERANCES[dtype])
