"""kernels.linear equals F.linear on every path: the few-row float32 split-bmm one and the fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import linear
from kernels.linear import SPLIT_MAX_ROWS, _split_bmm_applies


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows: int, dtype: torch.dtype, with_bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(130, 96, generator=g).to(dtype)
    b = torch.randn(130, generator=g).to(dtype) if with_bias else None
    out = linear(x, w, b)
    want = F.linear(x, w, b)
    assert out.shape == want.shape and out.dtype == want.dtype and out.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), want.float(), atol=tol * 10, rtol=tol)


def test_split_path_taken_only_where_it_was_measured_faster() -> None:
    w = torch.randn(64, 32)
    assert _split_bmm_applies(torch.randn(1, 32), w)
    assert _split_bmm_applies(torch.randn(SPLIT_MAX_ROWS, 32), w)
    assert not _split_bmm_applies(torch.randn(SPLIT_MAX_ROWS + 1, 32), w)
    assert not _split_bmm_applies(torch.randn(1, 32, dtype=torch.bfloat16), w.bfloat16())
    assert not _split_bmm_applies(torch.randn(1, 32), torch.randn(63, 32))  # odd rows: no halves
    assert not _split_bmm_applies(torch.randn(1, 32), torch.randn(32, 64).t())  # not contiguous
