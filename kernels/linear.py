"""`linear(x, weight, bias)`: F.linear, except for the few-row float32 case on CPU.

Measured on this project's CPUs (x86, MKL through torch 2.13, weights streaming from memory): for
x with 1-3 rows, F.linear runs MKL's gemv/small-gemm path at about half the bandwidth of a batched
matmul over two halves of the weight rows, `bmm(w.view(2, N/2, K), x^T)`; from about 8 rows on,
F.linear is as fast or faster, and for bfloat16 F.linear wins at every size. Decode at batch 1
(every weight read once per token) is exactly this case, so the engine routes its projections
through here. Same math, only the summation order inside each dot product may differ (last-bit
float differences, as between any two BLAS kernels). See bench/engine.py for the effect.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SPLIT_MAX_ROWS = 3  # above this, F.linear is the faster path (measured)


def _split_bmm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.dim() == 2 and 0 < x.shape[0] <= SPLIT_MAX_ROWS and weight.shape[0] % 2 == 0
            and weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N], as F.linear."""
    if not _split_bmm_applies(x, weight):
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    n, k = weight.shape
    halves = torch.bmm(weight.view(2, n // 2, k), x.t().unsqueeze(0).expand(2, k, rows))  # [2, N/2, M]
    out = halves.permute(2, 0, 1).contiguous().view(rows, n)  # no copy for one row
    return out if bias is None else out.add_(bias)
