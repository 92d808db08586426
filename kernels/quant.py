"""KV (de)quantization references: int8 per (token, head), int8 KV blocks (K per channel, V per
token), fp8 e4m3 per block. The CPU path and the ground truth for `kernels/triton_quant.py`.

Mental model: a scale maps the largest magnitude of its group onto the format's largest value, so
nothing saturates and every group uses the whole code range.
- int8, one scale per row of `head_dim` values (one token of one head): scale = amax / 127,
  q = round_half_even(x / scale) in [-127, 127]. Used for int8 KV storage.
  Bound: |x - dequant(q)| <= scale / 2 per element, plus float32 rounding of the division and the
  product, at most 2^-15 * scale; so |x - x̂| <= scale * (1/2 + 2^-15).
- int8 KV blocks (the transfer codec's int8), on KV as read out of a paged cache,
  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: K gets one scale per (layer,
  block, head, channel) over the block's tokens, V one per (layer, block, token, head) over head_dim.
  K has outlier channels (on SmolLM2 the channel maxima of one head span 0.3 to 15): a per-token
  scale is set by the few large channels and leaves the small ones a handful of codes; a
  per-channel one gives each channel its own range. V has no such channels and is read per token,
  so it keeps per-token scales (KIVI, arXiv 2402.02750). Per block, so a block decodes on its own.
  Scales are bfloat16, rounded *up* from amax / 127 by integer arithmetic on the float32 bits (so
  nothing exceeds 127, and torch and triton agree bit for bit); at most 2^-7 above amax / 127.
  Bound, with s the stored scale of the element's group: |x - x̂| <= s * (1/2 + 2^-15).
  Bytes per block of one head: bs * D + 2 * D (K) and bs * D + 2 * bs (V).
- fp8 e4m3 (`torch.float8_e4m3fn`, 3 mantissa bits, max 448), one scale per leading index (a KV block
  of one layer: [block_size, num_kv_heads, head_dim]): scale = amax / 448. Normal values
  (|x / scale| >= 2^-6) round to 3 mantissa bits, relative error <= 2^-4; below that the subnormal
  spacing 2^-9 gives an absolute floor 2^-10 * scale. Bound (covers float32 rounding too):
  |x - x̂| <= 2^-4 * |x| + 2^-10 * scale.
An all-zero group gets scale 0 and quantizes to zeros (no division by zero).
All directions compute in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # zero groups divide by 1: their values are all 0 and stay 0
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_int8_ref(
    x: torch.Tensor,  # [..., head_dim] float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q [..., head_dim] int8, scale [...] float32), one scale per row of the last dim.
    Round trip: |x - dequantize_int8_ref(q, scale)| <= scale * (1/2 + 2^-15) elementwise."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX  # [...]
    y = xf / _safe(scale).unsqueeze(-1)
    return _int8_codes(y), scale


def _int8_codes(y: torch.Tensor) -> torch.Tensor:
    return torch.round(y).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)


def ceil_bf16(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= x, for finite float32 x >= 0, returned as float32: add the
    dropped 16 bits' maximum and truncate (exact, no rounding mode involved)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & -0x10000).view(torch.float32)


def quantize_int8_kv_ref(
    kv: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q int8 like kv, k_scale [num_layers, num_blocks, num_kv_heads, head_dim] bf16,
    v_scale [num_layers, num_blocks, block_size, num_kv_heads] bf16): K per channel over each
    block's tokens, V per token. Round trip: |x - x̂| <= s * (1/2 + 2^-15), s the element's scale."""
    k, v = kv.float().unbind(1)  # [L, n, bs, H, D] each
    k_scale = ceil_bf16(k.abs().amax(dim=2) / INT8_MAX)  # [L, n, H, D]
    v_scale = ceil_bf16(v.abs().amax(dim=-1) / INT8_MAX)  # [L, n, bs, H]
    qk = _int8_codes(k / _safe(k_scale).unsqueeze(2))
    qv = _int8_codes(v / _safe(v_scale).unsqueeze(-1))
    return torch.stack((qk, qv), dim=1), k_scale.bfloat16(), v_scale.bfloat16()


def dequantize_int8_kv_ref(
    q: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim] int8
    k_scale: torch.Tensor,  # [num_layers, num_blocks, num_kv_heads, head_dim] bf16
    v_scale: torch.Tensor,  # [num_layers, num_blocks, block_size, num_kv_heads] bf16
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    # float32 products rounded once into `out` (as .float() * scale then .to(dtype)), with no
    # intermediate copies: this is the CPU decode path
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    torch.mul(q[:, 0], k_scale.float().unsqueeze(2), out=out[:, 0])
    torch.mul(q[:, 1], v_scale.float().unsqueeze(-1), out=out[:, 1])
    return out


def dequantize_int8_ref(
    q: torch.Tensor,  # [..., head_dim] int8
    scale: torch.Tensor,  # [...] float32
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def quantize_fp8_ref(
    x: torch.Tensor,  # [num_blocks, ...] float, one scale per leading index
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q [num_blocks, ...] float8_e4m3fn, scale [num_blocks] float32).
    Round trip: |x - dequantize_fp8_ref(q, scale)| <= 2^-4 * |x| + 2^-10 * scale elementwise."""
    xf = x.float().reshape(x.shape[0], -1)  # [num_blocks, elems]
    scale = xf.abs().amax(dim=1) / FP8_E4M3_MAX  # [num_blocks]
    # the clamp keeps float32 rounding of x / scale (448.00003) from overflowing to NaN
    y = (xf / _safe(scale).unsqueeze(1)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.to(FP8_DTYPE).reshape(x.shape), scale


def dequantize_fp8_ref(
    q: torch.Tensor,  # [num_blocks, ...] float8_e4m3fn
    scale: torch.Tensor,  # [num_blocks] float32
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    shape = (-1,) + (1,) * (q.dim() - 1)
    return (q.float() * scale.float().reshape(shape)).to(dtype)


def dequantize_kv_ref(
    cache_rows: torch.Tensor,  # [..., head_dim], gathered from a KV cache
    scale_rows: torch.Tensor | None,  # [...] float32 when the cache is int8, else None
) -> torch.Tensor:
    """KV as the attention references consume it: float caches unchanged, int8 ones in float32."""
    if cache_rows.dtype != torch.int8:
        return cache_rows
    if scale_rows is None:
        raise ValueError("int8 KV cache needs k_scale/v_scale")
    return dequantize_int8_ref(cache_rows, scale_rows)
