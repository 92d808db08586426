"""Triton KV write: scatter the new tokens' K and V into their cache slots (the torch reference is
`kernels.reference.write_kv_ref`).

Mental model: one program per new token moves that token's [num_kv_heads, head_dim] K and V rows to
slot `slot_mapping[t]` = block_id * block_size + offset, so the write is a gather-free scatter whose
cost is one read and one write of the new KV. With an int8 cache the program also quantizes each
(token, head) row with its own scale (amax / 127, round half to even, as `kernels.quant`) and writes
the scale beside it; attention dequantizes on load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_quant import quantize_rows_int8
from kernels.triton_validate import check_kv_scales
from kernels.triton_support import (
    FLOAT_KV_DTYPES, check_device, check_dtype, check_last_dim_contiguous, check_shape, next_pow2,
)


@triton.jit
def _write_one(
    src_ptr, cache_ptr, scale_ptr, t, block, offset,
    stride_st, stride_sh, stride_cb, stride_ct, stride_ch, stride_zb, stride_zt,
    NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, KV_INT8: tl.constexpr,
):
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HEAD_DIM)
    mask = (h < NUM_KV_HEADS)[:, None]
    x = tl.load(src_ptr + t * stride_st + h[:, None] * stride_sh + d[None, :], mask=mask, other=0.0)
    dst = cache_ptr + block * stride_cb + offset * stride_ct + h[:, None] * stride_ch + d[None, :]
    if KV_INT8:
        q, scale = quantize_rows_int8(x.to(tl.float32))  # [H_PAD, HEAD_DIM], [H_PAD]
        tl.store(dst, q, mask=mask)
        tl.store(scale_ptr + block * stride_zb + offset * stride_zt + h, scale, mask=h < NUM_KV_HEADS)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (int8 KV only; else unused)
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32
    slot_ptr,  # [num_tokens] int64
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,  # cache strides (K and V caches share them)
    stride_zb, stride_zt,  # scale strides (last dim contiguous)
    NUM_KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_INT8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # block * stride overflows int32 on big caches
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    _write_one(key_ptr, k_cache_ptr, k_scale_ptr, t, block, offset, stride_kt, stride_kh,
               stride_cb, stride_ct, stride_ch, stride_zb, stride_zt,
               NUM_KV_HEADS, H_PAD, HEAD_DIM, KV_INT8)
    _write_one(value_ptr, v_cache_ptr, v_scale_ptr, t, block, offset, stride_vt, stride_vh,
               stride_cb, stride_ct, stride_ch, stride_zb, stride_zt,
               NUM_KV_HEADS, H_PAD, HEAD_DIM, KV_INT8)


def write_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, every slot valid (>= 0)
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, int8 KV only
    v_scale: torch.Tensor | None = None,
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = key.shape[0]
    kv_int8 = k_cache.dtype == torch.int8
    tensors = [key, value, k_cache, v_cache, slot_mapping]
    check_shape("key", key, (num_tokens, num_kv_heads, head_dim))
    check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_dtype("key", key, FLOAT_KV_DTYPES)
    check_dtype("value", value, (key.dtype,))
    check_dtype("k_cache", k_cache, FLOAT_KV_DTYPES + (torch.int8,))
    check_dtype("v_cache", v_cache, (k_cache.dtype,))
    check_dtype("slot_mapping", slot_mapping, (torch.int64, torch.int32))
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    k_scale, v_scale = check_kv_scales(kv_int8, k_cache, k_scale, v_scale, tensors)
    check_device(*tensors)
    if head_dim != next_pow2(head_dim):
        raise ValueError(f"head_dim {head_dim} must be a power of two")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1),
        NUM_KV_HEADS=num_kv_heads, H_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, KV_INT8=kv_int8,
    )
