"""The two device functions both paged attention kernels are built from: load a tile of KV through
the block table, and fold it into an online softmax.

Mental model: a tile is TILE_N consecutive token positions of one sequence and one KV head. Position
p lives in block `block_table[p // BLOCK_SIZE]` at offset `p % BLOCK_SIZE`, so a tile may span several
blocks (or part of one) and the gather is per row; positions past the context are masked to -inf.
The softmax runs in base 2 (`qk_scale` = scale * log2 e) with a running max `m`, a running sum `l`
and an unnormalized accumulator `acc`, so the tiles can be visited once, in any order, in pieces.
int8 KV: the integer codes go into the dots unchanged (exact in bf16/fp16/fp32) and the per-token
scales multiply the score columns (K) and the probabilities (V), which is the dequantized math.
DOT_UPCAST is set only under the triton interpreter, whose bf16 `tl.dot` multiplies the raw bit
patterns: there the same bf16 operands are widened to float32 first, which is what the tensor cores
compute (bf16 products, float32 accumulation).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_kv_tile(
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (KV_INT8 only)
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (KV_INT8 only)
    table_ptr,  # [max_blocks] int32, this sequence's block table row
    pos,  # [TILE_N] int32 token positions
    valid,  # [TILE_N] bool, pos < context length
    kv_head,
    stride_cb, stride_ct, stride_ch, stride_zb, stride_zt,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, KV_INT8: tl.constexpr,
):
    """-> k [TILE_N, HEAD_DIM], v [TILE_N, HEAD_DIM] (cache dtype), k_scale, v_scale [TILE_N] f32."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offset = pos % BLOCK_SIZE
    rows = block * stride_cb + offset * stride_ct + kv_head * stride_ch  # [TILE_N]
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0)
    v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0)
    if KV_INT8:
        srows = block * stride_zb + offset * stride_zt + kv_head
        k_scale = tl.load(k_scale_ptr + srows, mask=valid, other=0.0)
        v_scale = tl.load(v_scale_ptr + srows, mask=valid, other=0.0)
    else:
        k_scale = tl.zeros([pos.shape[0]], dtype=tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    if DOT_UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=DOT_PRECISION)
    return c


@triton.jit
def attend_tile(
    q,  # [M, HEAD_DIM] compute dtype (fp32/bf16/fp16)
    k,  # [N, HEAD_DIM] cache dtype
    v,  # [N, HEAD_DIM] cache dtype
    k_scale,  # [N] float32 (KV_INT8 only)
    v_scale,  # [N] float32 (KV_INT8 only)
    visible,  # [M, N] or [1, N] bool
    m_i,  # [M] float32 running max (base 2)
    l_i,  # [M] float32 running sum
    acc,  # [M, HEAD_DIM] float32
    qk_scale,
    KV_INT8: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    if KV_INT8:
        # via float32: int -> bf16 casts are not supported by the interpreter
        k = k.to(tl.float32).to(q.dtype)
        v = v.to(tl.float32).to(q.dtype)
    s = _dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST)  # [M, N] float32
    if KV_INT8:
        s = s * (k_scale * qk_scale)[None, :]
    else:
        s = s * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # a row that has seen nothing yet keeps m = -inf; shift by 0 then (exp2(-inf - -inf) is NaN)
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(s - m_shift[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV_INT8:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v.to(q.dtype), DOT_PRECISION, DOT_UPCAST)
    return m_new, l_i, acc
