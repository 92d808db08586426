"""The torch references against naive math: paged attention vs `dense_causal_attention` (float64,
explicit loops) on the same KV gathered densely, and the KV write vs the exact slot arithmetic."""

from __future__ import annotations

import pytest
import torch
from tests.kernels.paged_kv_data import make_batch
from tests.kernels.tolerances import assert_close

from kernels.quant import quantize_int8_ref
from kernels.reference import (
    dense_causal_attention, paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref,
)

SCALE = 0.125
KV = [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True), (torch.bfloat16, True)]
HEADS = [(4, 4, 16), (6, 2, 32)]  # (num_heads, num_kv_heads, block_size): GQA 1 and 3


@pytest.mark.parametrize("dtype,kv_int8", KV)
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", HEADS)
def test_decode_ref_equals_dense(
    dtype: torch.dtype, kv_int8: bool, num_heads: int, num_kv_heads: int, block_size: int
) -> None:
    seq_lens = [37, 5, 70, 32]  # partial last blocks, a single partial block, an exact multiple
    b = make_batch(seq_lens, [1] * 4, num_heads, num_kv_heads, 64, block_size, dtype, kv_int8)
    out = paged_decode_attention_ref(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                     SCALE, k_scale=b.k_scale, v_scale=b.v_scale)
    assert out.dtype == dtype
    for i in range(len(seq_lens)):
        expected = dense_causal_attention(b.query[i : i + 1], b.dense_k[i], b.dense_v[i], SCALE)
        assert_close(out[i : i + 1], expected, dtype)


def test_decode_ref_reads_blocks_through_the_table() -> None:
    # the test data can tell blocks apart: pointing entry 1 at block 0's data changes the answer
    # (a swap would not: attention over a set of positions ignores their order)
    b = make_batch([37], [1], 2, 2, 64, 16, torch.float32)
    expected = dense_causal_attention(b.query, b.dense_k[0], b.dense_v[0], SCALE)
    b.block_tables[0, 1] = b.block_tables[0, 0]
    out = paged_decode_attention_ref(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, SCALE)
    assert (out.double() - expected).abs().max() > 1e-2


@pytest.mark.parametrize("dtype,kv_int8", KV)
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", HEADS)
def test_prefill_ref_equals_dense(
    dtype: torch.dtype, kv_int8: bool, num_heads: int, num_kv_heads: int, block_size: int
) -> None:
    # cached prefixes of 17 and 67 tokens, and one sequence with no prefix
    seq_lens, query_lens = [37, 5, 70], [20, 5, 3]
    b = make_batch(seq_lens, query_lens, num_heads, num_kv_heads, 64, block_size, dtype, kv_int8)
    out = paged_prefill_attention_ref(b.query, b.k_cache, b.v_cache, b.block_tables, seq_lens,
                                      b.query_start_loc_list, SCALE, b.k_scale, b.v_scale)
    qsl = b.query_start_loc_list
    for i in range(len(seq_lens)):
        expected = dense_causal_attention(b.query[qsl[i] : qsl[i + 1]], b.dense_k[i], b.dense_v[i], SCALE)
        assert_close(out[qsl[i] : qsl[i + 1]], expected, dtype)


@pytest.mark.parametrize("q_block", [7, 16, 256])
def test_prefill_ref_in_query_blocks_equals_dense(monkeypatch: pytest.MonkeyPatch, q_block: int) -> None:
    # queries longer than a block, with and without a cached prefix, blocks that do not divide
    # them: each query block attends over the context up to its own last token
    import kernels.reference as reference

    monkeypatch.setattr(reference, "Q_BLOCK", q_block)
    seq_lens, query_lens = [300, 45, 33], [300, 40, 16]
    b = make_batch(seq_lens, query_lens, 6, 2, 64, 16, torch.float32)
    out = paged_prefill_attention_ref(b.query, b.k_cache, b.v_cache, b.block_tables, seq_lens,
                                      b.query_start_loc_list, SCALE)
    qsl = b.query_start_loc_list
    for i in range(len(seq_lens)):
        expected = dense_causal_attention(b.query[qsl[i] : qsl[i + 1]], b.dense_k[i], b.dense_v[i], SCALE)
        assert_close(out[qsl[i] : qsl[i + 1]], expected, torch.float32)


def _caches(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    # a sentinel no write produces, so an untouched slot is recognisable
    if dtype == torch.int8:
        return torch.full(shape, -128, dtype=dtype), torch.full(shape, -128, dtype=dtype)
    return torch.full(shape, 1e4).to(dtype), torch.full(shape, -1e4).to(dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_write_kv_ref_places_each_token_in_its_slot(cache_dtype: torch.dtype) -> None:
    num_blocks, block_size, hkv, d = 6, 16, 3, 64
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:29]  # scattered, any block
    key = torch.randn(29, hkv, d, generator=gen)
    value = torch.randn(29, hkv, d, generator=gen)
    k_cache, v_cache = _caches(cache_dtype, (num_blocks, block_size, hkv, d))
    scales = None
    if cache_dtype == torch.int8:
        scales = (torch.full((num_blocks, block_size, hkv), -1.0), torch.full((num_blocks, block_size, hkv), -1.0))
    write_kv_ref(key, value, k_cache, v_cache, slots, *(scales or (None, None)))

    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots] = True
    for new, cache, sentinel_scale in ((key, k_cache, scales and scales[0]), (value, v_cache, scales and scales[1])):
        for i, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, block_size)
            if cache_dtype == torch.int8:
                q, s = quantize_int8_ref(new[i])
                assert torch.equal(cache[block, offset], q)
                assert torch.equal(sentinel_scale[block, offset], s)
            else:
                assert torch.equal(cache[block, offset], new[i].to(cache_dtype))
        untouched = cache.view(-1, hkv, d)[~written]
        assert torch.equal(untouched, torch.full_like(untouched, untouched.flatten()[0].item()))
        if cache_dtype == torch.int8:
            assert (sentinel_scale.view(-1, hkv)[~written] == -1.0).all()


def test_write_kv_ref_int8_needs_scales() -> None:
    k_cache, v_cache = _caches(torch.int8, (2, 16, 1, 64))
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_ref(torch.randn(1, 1, 64), torch.randn(1, 1, 64), k_cache, v_cache, torch.tensor([3]))
