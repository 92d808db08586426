"""Plain torch references for the paged-KV kernels. They are the CPU path and the ground truth the
triton kernels are tested against; keep them obviously correct first, fast second.

KV cache layout (one tensor per layer and per K/V): [num_blocks, block_size, num_kv_heads, head_dim].
int8 KV storage adds one float32 scale per (slot, head): k_scale/v_scale [num_blocks, block_size,
num_kv_heads] (see `kernels/quant.py`); the references dequantize what they gather and attend in
float32, then return the query's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.quant import dequantize_kv_ref, quantize_int8_ref

Q_BLOCK = 256  # prefill attention's query block (see paged_prefill_attention_ref)


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, every slot valid (>= 0)
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, int8 KV only
    v_scale: torch.Tensor | None = None,
) -> None:
    """Token i's K/V go to flat slot `slot_mapping[i]` (= block_id * block_size + offset). An int8
    cache stores round(x / scale) with a fresh scale per (token, head)."""
    for new, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        num_kv_heads, head_dim = cache.shape[2:]
        flat = cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        if cache.dtype == torch.int8:
            if scale is None:
                raise ValueError("int8 KV cache needs k_scale/v_scale")
            q, s = quantize_int8_ref(new)
            flat.index_copy_(0, slot_mapping, q)
            scale.view(-1, num_kv_heads).index_copy_(0, slot_mapping, s)
        else:
            flat.index_copy_(0, slot_mapping, new.to(cache.dtype))


def _gather(
    cache: torch.Tensor, scale: torch.Tensor | None, block_ids: torch.Tensor, length: int
) -> torch.Tensor:
    # [num_blocks_used, block_size, H, D] -> [length, H, D], dequantized if int8
    rows = cache.index_select(0, block_ids).flatten(0, 1)[:length]
    scales = None if scale is None else scale.index_select(0, block_ids).flatten(0, 1)[:length]
    return dequantize_kv_ref(rows, scales)


def _gather_padded(
    cache: torch.Tensor, scale: torch.Tensor | None, table: torch.Tensor
) -> torch.Tensor:
    # [S, nb] block ids -> [S, Hkv, nb * block_size, D] float32, a strided view (heads are not moved).
    # One index_select (whole blocks are contiguous rows: far cheaper on CPU than advanced indexing
    # with a 2-D index), then at most one copy, the conversion to float32.
    num_seqs, nb = table.shape
    _, block_size, num_heads, head_dim = cache.shape
    idx = table.reshape(-1)
    rows = cache.index_select(0, idx)  # [S * nb, bs, H, D]
    rows = dequantize_kv_ref(rows, None if scale is None else scale.index_select(0, idx)).float()
    return rows.view(num_seqs, nb * block_size, num_heads, head_dim).transpose(1, 2)


def paged_decode_attention_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_seq_len: int | None = None,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, int8 KV only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched: each sequence's blocks are gathered into a padded [S, Hkv, L, D] float32 view and
    all sequences attend in one 4-D SDPA call (torch's CPU flash kernel; GQA without repeating K/V),
    masked by length. Computes in float32 whatever the cache dtype (measured on CPU at decode sizes:
    bf16 attention kernels are several times slower than float32 ones, and float32 flash beats
    float32 matmul + softmax by 15-25%) and returns the query's dtype."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(max_seq_len if max_seq_len is not None else seq_lens.max())
    table = block_tables[:, : -(-max_len // block_size)].long()
    k = _gather_padded(k_cache, k_scale, table)  # [S, Hkv, L, D]
    v = _gather_padded(v_cache, v_scale, table)
    valid = torch.arange(k.shape[2], device=query.device)[None, :] < seq_lens[:, None]  # [S, L]
    out = F.scaled_dot_product_attention(
        query.float()[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [S, Hq, 1, D]
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], the new tokens of every sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int] | tuple[int, ...],
    query_start_loc: list[int] | tuple[int, ...],
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, int8 KV only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged causal attention: each sequence's new tokens see its cached prefix and each other.

    The new tokens attend in query blocks of `Q_BLOCK`, each over the context up to its own last
    token, so the masked upper triangle is not computed (torch's CPU flash kernel tiles keys by 512
    and computes a whole tile even where a causal mask hides it: one call over a 512-token chunk
    costs as much causal as not). Measured on 2 CPU cores, SmolLM2's heads, a 1,024-token prompt
    in two 512-token chunks: 17% less attention time than one call per chunk."""
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        block_ids = block_tables[i, : -(-seq_len // block_size)].long()
        k = _gather(k_cache, k_scale, block_ids, seq_len).transpose(0, 1)  # [Hkv, L, D]
        v = _gather(v_cache, v_scale, block_ids, seq_len).transpose(0, 1)
        q = query[start:end].transpose(0, 1).to(k.dtype)  # [Hq, q_len, D]
        prefix = seq_len - q_len  # new token j sits at position prefix + j, sees positions <= its own
        for b in range(0, q_len, Q_BLOCK):
            b_end = min(q_len, b + Q_BLOCK)
            ctx = prefix + b_end
            mask = None
            if prefix + b:
                pos_q = torch.arange(prefix + b, ctx, device=query.device)
                mask = torch.arange(ctx, device=query.device)[None, :] <= pos_q[:, None]
            # 4-D inputs: on CPU that selects torch's flash-attention kernel (2-3x faster than the
            # math fallback 3-D inputs get, measured at 100-512 tokens, float32 and bfloat16)
            o = F.scaled_dot_product_attention(
                q[None, :, b:b_end], k[None, :, :ctx], v[None, :, :ctx], attn_mask=mask, is_causal=mask is None,
                scale=scale, enable_gqa=num_heads != num_kv_heads,
            )[0]
            out[start + b : start + b_end] = o.transpose(0, 1).to(query.dtype)
    return out


def dense_causal_attention(
    query: torch.Tensor,  # [q_len, Hq, D], the last q_len positions of the context
    key: torch.Tensor,  # [L, Hkv, D]
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Naive softmax(QK^T)V with explicit loops over heads: the ground truth for tests."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q_len, num_heads, value.shape[-1], dtype=torch.float64)
    for h in range(num_heads):
        q = query[:, h].double()
        k = key[:, h // group].double()
        v = value[:, h // group].double()
        scores = q @ k.T * scale  # [q_len, L]
        pos_q = torch.arange(seq_len - q_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > pos_q, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalise in float32 (x * rsqrt(mean(x^2) + eps), one fused op), cast back to
    x's dtype, then scale by the weight in that dtype."""
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)
