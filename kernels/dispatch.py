"""The only entry points the engine (and the transfer codec) call: pick a triton kernel on CUDA, the
torch reference otherwise (on CPU, decode attention over float caches runs the native C kernel of
kernels/cpu_native.py where it could be built). Keeping the choice here means the model code never branches on the device.

int8 KV storage: pass an int8 k_cache/v_cache plus `k_scale`/`v_scale` float32 caches shaped
[num_blocks, block_size, num_kv_heads] to both `write_kv` (which quantizes) and `paged_attention`
(which dequantizes). Float caches ignore the scales (leave them None).
"""

from __future__ import annotations

import torch

from kernels.cpu_native import paged_decode_attention_native, rms_norm_native
from kernels.metadata import AttentionMetadata
from kernels.quant import (
    dequantize_fp8_ref, dequantize_int8_kv_ref, dequantize_int8_ref, quantize_fp8_ref, quantize_int8_kv_ref,
    quantize_int8_ref,
)
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, rms_norm_ref, write_kv_ref
from kernels.triton_support import use_triton


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, int8 KV only
    v_scale: torch.Tensor | None = None,
) -> None:
    if use_triton(key, k_cache):
        from kernels.triton_kv_write import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: torch.Tensor | None = None,  # [num_blocks, block_size, num_kv_heads] f32, int8 KV only
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's paged context, in the query's dtype.
    Decodes (the leading `meta.num_decodes` sequences, one token each) go through the batched
    decode path, the rest through the ragged prefill path."""
    if use_triton(query, k_cache):
        return _paged_attention_triton(query, k_cache, v_cache, meta, scale, k_scale, v_scale)
    nd = meta.num_decodes
    if nd == meta.num_seqs:
        return _decode_cpu(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, meta.max_seq_len,
                           k_scale, v_scale)
    out = torch.empty_like(query)
    if nd:
        out[:nd] = _decode_cpu(query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                               max(meta.seq_lens_list[:nd]), k_scale, v_scale)
    qsl = meta.query_start_loc_list
    out[nd:] = paged_prefill_attention_ref(
        query[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.seq_lens_list[nd:],
        [q - qsl[nd] for q in qsl[nd:]], scale, k_scale, v_scale,
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (`rms_norm_ref`'s math): the native CPU kernel where it is built,
    the torch formula otherwise."""
    out = rms_norm_native(x, weight, eps)  # None off CPU or where it does not apply
    return out if out is not None else rms_norm_ref(x, weight, eps)


def _decode_cpu(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, max_seq_len: int, k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The native C kernel for float caches where it is built (kernels/cpu_native.py), else the reference."""
    if k_scale is None:
        out = paged_decode_attention_native(query, k_cache, v_cache, block_tables, seq_lens, scale)
        if out is not None:
            return out
    return paged_decode_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
                                      k_scale, v_scale)


def _paged_attention_triton(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> torch.Tensor:
    from kernels.triton_decode import paged_decode_attention_triton
    from kernels.triton_prefill import paged_prefill_attention_triton

    # a float cache sets the compute dtype (as the reference does); int8 KV computes in the query's
    q = query if k_cache.dtype in (torch.int8, query.dtype) else query.to(k_cache.dtype)
    nd, ns = meta.num_decodes, meta.num_seqs
    out = torch.empty_like(q)
    if nd:
        max_len = max(meta.seq_lens_list[:nd]) if meta.seq_lens_list else meta.max_seq_len
        out[:nd] = paged_decode_attention_triton(
            q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, max_len,
            k_scale, v_scale,
        )
    if nd < ns:
        qsl = meta.query_start_loc_list
        if qsl:
            max_q = max(qsl[i + 1] - qsl[i] for i in range(nd, ns))
        else:  # no host copy: one sync to read the lengths
            max_q = int((meta.query_start_loc[1:] - meta.query_start_loc[:-1])[nd:].max())
        start_loc = meta.query_start_loc[nd:]
        out[nd:] = paged_prefill_attention_triton(
            q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.seq_lens[nd:],
            (start_loc - start_loc[:1]).to(torch.int32), max_q, scale, k_scale, v_scale,
        )
    return out.to(query.dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] float -> (int8 [..., head_dim], float32 scale [...]); see kernels/quant.py."""
    if use_triton(x):
        from kernels.triton_quant import quantize_int8_triton

        return quantize_int8_triton(x.contiguous())
    return quantize_int8_ref(x)


def dequantize_int8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if use_triton(q, scale):
        from kernels.triton_quant import dequantize_int8_triton

        return dequantize_int8_triton(q.contiguous(), scale.contiguous(), dtype)
    return dequantize_int8_ref(q, scale, dtype)


def quantize_int8_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[L, 2, n, bs, H, D] float -> (int8 like kv, K scales [L, n, H, D] bf16 (per channel),
    V scales [L, n, bs, H] bf16 (per token)); see kernels/quant.py."""
    if use_triton(kv):
        from kernels.triton_quant import quantize_int8_kv_triton

        return quantize_int8_kv_triton(kv.contiguous())
    return quantize_int8_kv_ref(kv)


def dequantize_int8_kv(
    q: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if use_triton(q, k_scale, v_scale):
        from kernels.triton_quant import dequantize_int8_kv_triton

        return dequantize_int8_kv_triton(q.contiguous(), k_scale.contiguous(), v_scale.contiguous(), dtype)
    return dequantize_int8_kv_ref(q, k_scale, v_scale, dtype)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_blocks, ...] float -> (float8_e4m3fn [num_blocks, ...], float32 scale [num_blocks])."""
    if use_triton(x):
        from kernels.triton_quant import quantize_fp8_triton

        return quantize_fp8_triton(x.contiguous())
    return quantize_fp8_ref(x)


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if use_triton(q, scale):
        from kernels.triton_quant import dequantize_fp8_triton

        return dequantize_fp8_triton(q.contiguous(), scale.contiguous(), dtype)
    return dequantize_fp8_ref(q, scale, dtype)
