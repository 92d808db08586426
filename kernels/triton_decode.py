"""Triton paged decode attention (reference: `kernels.reference.paged_decode_attention_ref`).

Mental model: decode is a bandwidth problem: each sequence's one query token must read its whole
context's K and V once. A program owns (sequence, KV head, split): it loads the GROUP query heads
that share the KV head as the rows of one [GROUP_PAD, D] tile (GQA: KV read once per group, not
per query head), and walks its share of the context TILE_N tokens at a time with an online softmax.
With few sequences (batch 1 at 32k) there are too few (sequence, KV head) pairs to fill the GPU, so
the context is cut into NUM_SPLITS pieces (flash-decoding); each piece writes its normalized partial
output and log-sum-exp, and a second small kernel merges them with weights exp2(lse_i - max lse).
With NUM_SPLITS == 1 the first kernel writes the final output and the merge is skipped.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_paged_tile import attend_tile, load_kv_tile
from kernels.triton_support import dot_config, num_sms, next_pow2
from kernels.triton_validate import check_paged_kv

MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr, v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (KV_INT8 only)
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, head_dim] (NUM_SPLITS == 1)
    part_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32 (NUM_SPLITS > 1)
    part_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32, base 2 (NUM_SPLITS > 1)
    qk_scale,  # softmax scale * log2(e)
    stride_qs, stride_qh, stride_os, stride_oh, stride_bt,
    stride_cb, stride_ct, stride_ch, stride_zb, stride_zt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    KV_INT8: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, TILE_N)
    heads = kv_head * GROUP + g  # [GROUP_PAD]
    g_ok = g < GROUP
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)  # [GROUP_PAD, HEAD_DIM]
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + n
        valid = pos < seq_len
        k, v, k_scale, v_scale = load_kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, pos, valid, kv_head,
            stride_cb, stride_ct, stride_ch, stride_zb, stride_zt, BLOCK_SIZE, HEAD_DIM, KV_INT8)
        m_i, l_i, acc = attend_tile(q, k, v, k_scale, v_scale, valid[None, :], m_i, l_i, acc,
                                    qk_scale, KV_INT8, DOT_PRECISION, DOT_UPCAST)

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        # an empty split (short sequence) contributes weight exp2(-inf) = 0 to the merge
        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
        row = (seq * tl.num_programs(1) * GROUP + heads).to(tl.int64) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None],
                 mask=g_ok[:, None])
        tl.store(part_lse_ptr + row, lse, mask=g_ok)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,  # [num_seqs * num_heads, NUM_SPLITS, head_dim] float32
    part_lse_ptr,  # [num_seqs * num_heads, NUM_SPLITS] float32, base 2
    out_ptr,  # [num_seqs, num_heads, head_dim]
    stride_os, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    row = tl.program_id(0)  # seq * NUM_HEADS + head
    sp = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    base = row.to(tl.int64) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + sp)  # [NUM_SPLITS]
    w = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 is never empty, so the max is finite
    parts = tl.load(part_out_ptr + (base + sp)[:, None] * HEAD_DIM + d[None, :])
    out = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
    seq = row // NUM_HEADS
    head = row % NUM_HEADS
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def choose_num_splits(num_programs: int, max_tiles: int, device: torch.device) -> int:
    """Enough programs for ~4 per SM, each split keeping >= 2 tiles; a power of two (a constexpr,
    so few compiled variants). On CPU (interpreter) one split."""
    if device.type != "cuda":
        return 1
    target = 4 * num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= target:
        return 1
    splits = min(next_pow2(-(-target // num_programs)), MAX_SPLITS)
    while splits > 1 and splits * 2 > max_tiles:
        splits //= 2
    return splits


def paged_decode_attention_triton(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    scale: float,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, int8 KV only
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,  # None: choose from the GPU's size
    tile_n: int | None = None,  # tokens per inner step; None: max(64, block_size)
) -> torch.Tensor:
    """Returns [num_seqs, num_heads, head_dim] in the query's dtype. A float cache must have the
    query's dtype; an int8 cache takes any float query."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    kv_int8, k_scale, v_scale = check_paged_kv(
        query, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    group = num_heads // num_kv_heads
    tile_n = tile_n or max(64, block_size)
    if tile_n < 16 or tile_n != next_pow2(tile_n):
        raise ValueError(f"tile_n {tile_n} must be a power of two >= 16")
    max_len = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
    splits = num_splits or choose_num_splits(
        num_seqs * num_kv_heads, triton.cdiv(max_len, tile_n), query.device)
    if splits != next_pow2(splits):
        raise ValueError(f"num_splits {splits} must be a power of two")
    precision, upcast = dot_config(query.dtype)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if splits > 1:
        part_out = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # unused: NUM_SPLITS == 1 prunes their stores
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        query, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, out, part_out, part_lse,
        scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_scale.stride(0), k_scale.stride(1),
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        TILE_N=tile_n, NUM_SPLITS=splits, KV_INT8=kv_int8,
        DOT_PRECISION=precision, DOT_UPCAST=upcast,
    )
    if splits > 1:
        _merge_splits_kernel[(num_seqs * num_heads,)](
            part_out, part_lse, out, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=splits, HEAD_DIM=head_dim)
    return out
