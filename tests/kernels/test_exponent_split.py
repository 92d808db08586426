"""The exponent split under the lossless zstd codec: C kernel against the torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_native
from kernels.exponent_split import merge_exponents, merge_exponents_ref, split_exponents, split_exponents_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def awkward(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal values over many exponents, and every special a KV tensor could hold."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.logspace(-30, 30, n)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-42, 65504.0])
    x[: len(specials)] = specials
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [9, 1000, 4097])
def test_split_matches_its_definition_and_merge_inverts_it(dtype: torch.dtype, n: int) -> None:
    x = awkward(n, dtype)
    width, bits = x.element_size(), 8 * x.element_size()
    exps, rest = split_exponents_ref(x)
    assert exps.shape == (n,) and rest.shape == (n * (width - 1),)
    words = x.view(torch.int16 if width == 2 else torch.int32).to(torch.int64) & ((1 << bits) - 1)
    assert torch.equal(exps.to(torch.int64), (words >> (bits - 9)) & 0xFF)
    sign = rest.reshape(n, width - 1)[:, -1].to(torch.int64) >> 7  # the sign tops the rest
    assert torch.equal(sign, words >> (bits - 1))
    back = merge_exponents_ref(exps, rest, dtype)
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))  # NaN payloads and -0 included


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler: the torch reference is the path")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 31, 4099])
def test_native_split_and_merge_equal_the_reference(dtype: torch.dtype, n: int) -> None:
    x = awkward(max(n, 8), dtype)[:n].reshape(-1, 1) if n > 1 else awkward(8, dtype)[4:5]
    exps, rest = split_exponents(x)
    ref_exps, ref_rest = split_exponents_ref(x)
    assert torch.equal(exps, ref_exps) and torch.equal(rest, ref_rest)
    assert torch.equal(merge_exponents(exps, rest, dtype).view(torch.uint8), x.reshape(-1).view(torch.uint8))


def test_other_widths_and_mismatched_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="2- or 4-byte"):
        split_exponents(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="rest bytes"):
        merge_exponents_ref(torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8), torch.float32)
