"""`linear(x, weight, bias, packed)` and `Linear`: the engine's projections on CPU, by the fastest
path measured for the shape.

Measured on this project's CPUs (x86 with AVX-512, torch 2.13, weights streaming from memory, 1-2
threads), SmolLM2's projection shapes:
- Prepacked oneDNN weights (`torch.ops.mkldnn._reorder_linear_weight` once at load, then
  `_linear_pointwise` per call) beat F.linear at every row count in both dtypes: bfloat16 at one row
  ~1.7x (gate_up 403 -> 222 us), float32 at 32 rows ~1.6x (lm_head 29.9 -> 11.7 ms). F.linear repacks
  the weight into the GEMM's blocked layout on every call; for decode-sized inputs that repacking
  costs as much as the multiply.
- For float32 with 1-3 rows a batched matmul over two halves of the weight rows,
  `bmm(w.view(2, N/2, K), x^T)`, is faster still (gate_up 244 us vs 316 us packed at 2 threads) and
  needs no second copy of the weight.
Same math on every path; only the summation order inside each dot product differs (last-bit float
differences, as between any two BLAS kernels). See bench/engine.py for the effect on whole steps.

`Linear` is an nn.Linear that holds the packed copy beside its weight: `pack()` makes it (the
engine's model runner packs every `Linear` of a CPU model once its dtype is final), anything that
moves or recasts the module drops it, and `linear` ignores a packed copy whose dtype does not match
the input. The packed copy is extra memory (one more copy of each packed weight).

oneDNN keeps every matmul it builds, with its scratch memory, in two caches keyed by shape (its own
primitive cache and ideep's), 1024 entries each by default. A serving engine sees a new row count at
almost every prefill step, so those caches grow for hours: measured with SmolLM2 in bfloat16, ~450
MiB per engine before they fill. `bound_onednn_caches` caps them (128 entries: ~57 MiB, same step
times, since one step reuses a handful of shapes across all layers; 1 entry is ~40% slower).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

SPLIT_MAX_ROWS = 3  # float32 rows up to which the split bmm beats the packed path (measured)
PACK_DTYPES = (torch.float32, torch.bfloat16)


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


PACK_ROWS_HINT = 32  # measured: float32 at 8-32 rows 15-25% faster than packing for 1 row, 1 row unchanged


def prepack(weight: torch.Tensor, rows_hint: int = PACK_ROWS_HINT) -> torch.Tensor | None:
    """A oneDNN-blocked copy of `weight` [N, K] for `linear(..., packed=)`, or None where packing does
    not apply (not CPU, another dtype, no oneDNN). `rows_hint` is the typical row count of the input
    (oneDNN picks its blocking for it); any row count works."""
    if weight.device.type != "cpu" or weight.dtype not in PACK_DTYPES or weight.dim() != 2 or not packing_available():
        return None
    if weight.dtype in _UNPACKABLE:
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows_hint)
    except RuntimeError:
        # oneDNN's bf16 path needs AVX-512 (or AVX-NE-CONVERT); on an AVX2-only CPU the reorder
        # refuses, and F.linear (which converts on the fly) is the path left.
        _UNPACKABLE.add(weight.dtype)
        return None


_UNPACKABLE: set[torch.dtype] = set()  # dtypes this CPU's oneDNN refused to pack


ONEDNN_CACHE_ENTRIES = 128
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's


def bound_onednn_caches(entries: int = ONEDNN_CACHE_ENTRIES) -> dict[str, str]:
    """Caps oneDNN's shape-keyed caches at `entries` each, unless the environment already sets them
    (an operator's value wins). Both are read at the process's first oneDNN call, so an engine calls
    this before it touches its weights; later calls change nothing. Returns the values in force."""
    if entries < 1:
        raise ValueError(f"oneDNN cache entries must be >= 1, got {entries}")
    return {name: os.environ.setdefault(name, str(entries)) for name in ONEDNN_CACHE_VARIABLES}


def _split_bmm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.dim() == 2 and 0 < x.shape[0] <= SPLIT_MAX_ROWS and weight.shape[0] % 2 == 0
            and weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) -> [..., N], as F.linear. `packed`: `prepack(weight)`."""
    if _split_bmm_applies(x, weight):
        rows = x.shape[0]
        n, k = weight.shape
        halves = torch.bmm(weight.view(2, n // 2, k), x.t().unsqueeze(0).expand(2, k, rows))  # [2, N/2, M]
        out = halves.permute(2, 0, 1).contiguous().view(rows, n)  # no copy for one row
        return out if bias is None else out.add_(bias)
    if packed is not None and x.device.type == "cpu" and x.dtype == packed.dtype and x.shape[-1] > 0:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear routed through `linear`, with an optional prepacked copy of its weight (`pack`).
    The packed copy is not a parameter or buffer: state dicts and `parameters()` are unchanged."""

    packed: torch.Tensor | None = None

    def pack(self) -> bool:
        """Makes the packed copy from the current weight; returns whether there is one now."""
        self.packed = prepack(self.weight)
        return self.packed is not None

    def unpack(self) -> None:
        self.packed = None

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def, override]
        self.packed = None  # .to(), .half(), .cuda(), ... : the copy would be stale
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)
