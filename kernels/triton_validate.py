"""Launch-time checks shared by the paged attention wrappers (decode and prefill).

Mental model: the kernels trust every shape, stride and dtype they are given and address memory
from them; this is the one place that makes that trust safe, so both wrappers call it first.
"""

from __future__ import annotations

import torch

from kernels.triton_support import (
    FLOAT_KV_DTYPES, check_device, check_dtype, check_head_dim, check_last_dim_contiguous,
    check_shape,
)


def check_paged_kv(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads] f32, int8 KV only
    v_scale: torch.Tensor | None,
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """-> (kv_int8, k_scale, v_scale); for a float cache the scales are placeholders (the cache
    itself) that the kernel never reads, so every launch has the same argument list."""
    if query.dim() != 3 or k_cache.dim() != 4:
        raise ValueError("query must be [tokens, heads, head_dim], caches [blocks, block, heads, dim]")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    num_seqs = seq_lens.shape[0]
    check_head_dim(head_dim)
    check_shape("k_cache", k_cache, (num_blocks, block_size, num_kv_heads, head_dim))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} does not match {num_seqs} seqs")
    check_dtype("query", query, FLOAT_KV_DTYPES)
    check_dtype("k_cache", k_cache, FLOAT_KV_DTYPES + (torch.int8,))
    check_dtype("v_cache", v_cache, (k_cache.dtype,))
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    kv_int8 = k_cache.dtype == torch.int8
    if not kv_int8 and query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the cache's {k_cache.dtype}")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    if block_tables.stride(1) != 1 or not seq_lens.is_contiguous():
        raise ValueError("block_tables rows and seq_lens must be contiguous")
    tensors = [query, k_cache, v_cache, block_tables, seq_lens]
    k_scale, v_scale = check_kv_scales(kv_int8, k_cache, k_scale, v_scale, tensors)
    check_device(*tensors)
    return kv_int8, k_scale, v_scale


def check_kv_scales(
    kv_int8: bool, k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
    tensors: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 KV: the per-(token, head) scale caches must match the cache's [blocks, block_size,
    heads] and share strides; they join `tensors` for the device check. Float KV: the cache itself
    stands in for both (the kernels' KV_INT8=False prunes every access to them)."""
    if not kv_int8:
        return k_cache, k_cache
    if k_scale is None or v_scale is None:
        raise ValueError("int8 KV cache needs k_scale and v_scale")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_shape(name, s, tuple(k_cache.shape[:3]))
        check_dtype(name, s, (torch.float32,))
        check_last_dim_contiguous(name, s)
    if k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must share strides")
    tensors += [k_scale, v_scale]
    return k_scale, v_scale
