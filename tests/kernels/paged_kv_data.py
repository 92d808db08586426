"""Random ragged batches over a paged KV cache, with the same KV also kept dense per sequence.

Blocks are handed out in a shuffled order (so a kernel that assumes contiguous blocks fails), unused
slots and unused block-table entries hold stale but finite values (a kernel that reads past a
sequence's length gets a visibly wrong answer, while the references, which gather whole blocks and
mask, stay finite), and int8 caches are filled through the quantize reference so the dense copy is
exactly what a correct kernel dequantizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant import dequantize_int8_ref, quantize_int8_ref

STALE = 30.0  # magnitude of what sits in slots no sequence owns


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [num_blocks, block_size, num_kv_heads] f32, int8 only
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    seq_lens_list: tuple[int, ...]
    query_start_loc_list: tuple[int, ...]
    dense_k: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim], as attended
    dense_v: list[torch.Tensor]

    @property
    def query_start_loc(self) -> torch.Tensor:
        return torch.tensor(self.query_start_loc_list, dtype=torch.int32, device=self.query.device)


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,  # query dtype; also the cache dtype unless kv_int8
    kv_int8: bool = False,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    max_blocks = max(blocks_per_seq) + 1
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_full = STALE * (1 + torch.rand(shape, generator=gen))
    v_full = -STALE * (1 + torch.rand(shape, generator=gen))
    flat_k, flat_v = k_full.view(-1, num_kv_heads, head_dim), v_full.view(-1, num_kv_heads, head_dim)
    dense_k, dense_v, used = [], [], 0
    for i, n in enumerate(seq_lens):
        ids = order[used : used + blocks_per_seq[i]]
        used += blocks_per_seq[i]
        table[i, : len(ids)] = ids.to(torch.int32)
        slots = (ids[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        flat_k[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        flat_v[slots] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        dense_k.append(flat_k[slots].clone())
        dense_v.append(flat_v[slots].clone())
    k_scale = v_scale = None
    if kv_int8:
        k_cache, k_scale = quantize_int8_ref(k_full)
        v_cache, v_scale = quantize_int8_ref(v_full)
        dense_k = [dequantize_int8_ref(*quantize_int8_ref(k)) for k in dense_k]
        dense_v = [dequantize_int8_ref(*quantize_int8_ref(v)) for v in dense_v]
    else:
        k_cache, v_cache = k_full.to(dtype), v_full.to(dtype)
        dense_k = [k.to(dtype) for k in dense_k]
        dense_v = [v.to(dtype) for v in dense_v]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], num_heads, head_dim, generator=gen).to(dtype)

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return PagedBatch(
        query=dev(query), k_cache=dev(k_cache), v_cache=dev(v_cache), k_scale=dev(k_scale),
        v_scale=dev(v_scale), block_tables=dev(table), seq_lens=dev(torch.tensor(seq_lens, dtype=torch.int32)),
        seq_lens_list=tuple(seq_lens), query_start_loc_list=tuple(qsl),
        dense_k=dense_k, dense_v=dense_v,
    )
