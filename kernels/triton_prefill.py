"""Triton paged prefill attention with a cached prefix (reference:
`kernels.reference.paged_prefill_attention_ref`).

Mental model: a ragged batch of sequences, each with q_len new tokens that are the last q_len of its
seq_len-token context (the first seq_len - q_len are a cached prefix: a prefix-cache hit or earlier
chunks of a chunked prefill). New token j sits at position prefix + j and sees positions <= its own.
A program owns BLOCK_M new tokens of one sequence and one query head, and walks the context through
the block table BLOCK_N tokens at a time with an online softmax, stopping at the last position its
rows can see (so the work is causal, not square). Programs whose row tile starts past the sequence's
q_len exit at once (the grid is sized by the longest sequence). One query head per program keeps
the tile shapes independent of the GQA ratio; the heads of a group read the same KV rows, which the
L2 cache absorbs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_paged_tile import attend_tile, load_kv_tile
from kernels.triton_support import check_shape, dot_config, next_pow2
from kernels.triton_validate import check_paged_kv


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr, v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (KV_INT8 only)
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32, context length including the new tokens
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_ct, stride_ch, stride_zb, stride_zt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_INT8: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    m_tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    kv_head = head // GROUP

    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among the new tokens
    m_ok = m < q_len
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_ok[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    pos_q = prefix + m  # absolute positions of the rows
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_end = tl.minimum(seq_len, prefix + (m_tile + 1) * BLOCK_M)  # the last row sees < kv_end
    for start in range(0, kv_end, BLOCK_N):
        pos = start + n
        valid = pos < kv_end
        k, v, k_scale, v_scale = load_kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, pos, valid, kv_head,
            stride_cb, stride_ct, stride_ch, stride_zb, stride_zt, BLOCK_SIZE, HEAD_DIM, KV_INT8)
        visible = valid[None, :] & (pos[None, :] <= pos_q[:, None])  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = attend_tile(q, k, v, k_scale, v_scale, visible, m_i, l_i, acc,
                                    qk_scale, KV_INT8, DOT_PRECISION, DOT_UPCAST)
    # every real row sees position 0, so l_i > 0 there; rows past q_len are not stored
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


def paged_prefill_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], the new tokens of every sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, >= each sequence's query length
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, starting at 0
    max_query_len: int,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, int8 KV only
    v_scale: torch.Tensor | None = None,
    block_m: int | None = None,  # new tokens per program; None: 64 (16 in the interpreter)
    block_n: int | None = None,  # context tokens per inner step; None: 64 (16 ...)
) -> torch.Tensor:
    """Returns [num_tokens, num_heads, head_dim] in the query's dtype. Same dtype rules as decode:
    a float cache has the query's dtype, an int8 cache takes any float query."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    kv_int8, k_scale, v_scale = check_paged_kv(
        query, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    if query_start_loc.dtype != torch.int32 or query_start_loc.device != query.device:
        raise ValueError("query_start_loc must be int32 on the query's device")
    small = query.device.type != "cuda"
    block_m = block_m or (16 if small else 64)
    block_n = block_n or (16 if small else 64)
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b != next_pow2(b):
            raise ValueError(f"{name} {b} must be a power of two >= 16")
    out = torch.empty_like(query)
    if num_seqs == 0 or num_tokens == 0 or max_query_len == 0:
        return out
    precision, upcast = dot_config(query.dtype)
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        query, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, out,
        scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_scale.stride(0), k_scale.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, KV_INT8=kv_int8, DOT_PRECISION=precision,
        DOT_UPCAST=upcast,
    )
    return out
