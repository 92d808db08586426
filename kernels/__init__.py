"""Compute over paged KV: attention, KV writes, (de)quantization. Triton on CUDA, torch otherwise.

Importing this package never imports triton; `kernels.dispatch` loads the triton modules on the
first CUDA call. Layout and contracts: `kernels/metadata.py`, `kernels/reference.py`,
`kernels/quant.py`.
"""

from kernels.dispatch import (
    dequantize_fp8, dequantize_int8, dequantize_int8_kv, paged_attention, quantize_fp8, quantize_int8,
    quantize_int8_kv, rms_norm, write_kv,
)
from kernels.linear import Linear, bound_onednn_caches, linear
from kernels.metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata", "Linear", "bound_onednn_caches", "dequantize_fp8", "dequantize_int8", "dequantize_int8_kv",
    "linear", "paged_attention", "quantize_fp8", "quantize_int8", "quantize_int8_kv", "rms_norm", "write_kv",
]
