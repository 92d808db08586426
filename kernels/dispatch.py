"""The only entry points the engine calls: pick a triton kernel on CUDA, the torch reference
otherwise. Keeping the choice here means the model code never branches on the device."""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention of every new token over its sequence's paged context. Decodes (the leading
    `meta.num_decodes` sequences, one token each) go through the batched decode path, the rest
    through the ragged prefill path."""
    nd = meta.num_decodes
    if nd == meta.num_seqs:
        return paged_decode_attention_ref(
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, meta.max_seq_len
        )
    out = torch.empty_like(query)
    if nd:
        out[:nd] = paged_decode_attention_ref(
            query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
            max(meta.seq_lens_list[:nd]),
        )
    qsl = meta.query_start_loc_list
    out[nd:] = paged_prefill_attention_ref(
        query[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.seq_lens_list[nd:],
        [q - qsl[nd] for q in qsl[nd:]], scale,
    )
    return out
