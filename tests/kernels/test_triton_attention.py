"""The triton paged attention kernels against the torch references (and, through the references,
against dense float64 math) on small ragged batches: contexts that are not a multiple of the block
size, partially filled last blocks, a sequence shorter than one block, GQA ratios 1, 3 and 8,
block sizes 16 and 32, head dims 64 and 128, fp32/bf16/fp16 and int8 KV, one and several splits.
Runs compiled on CUDA, through the triton interpreter elsewhere (tolerances: tests/kernels/tolerances.py).
"""

from __future__ import annotations

import pytest
import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import dense_causal_attention, paged_decode_attention_ref, paged_prefill_attention_ref
from tests.kernels.paged_kv_data import make_batch
from tests.kernels.tolerances import assert_close

triton = pytest.importorskip("triton", reason="triton not installed: only the references are tested")

from kernels.dispatch import _paged_attention_triton  # noqa: E402
from kernels.triton_decode import paged_decode_attention_triton  # noqa: E402
from kernels.triton_prefill import paged_prefill_attention_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.125
SEQ_LENS = [37, 5, 70]  # 2 full blocks + 5, less than a block, 4 full blocks + 6 (block 16)

# (dtype, kv_int8, num_heads, num_kv_heads, head_dim, block_size, num_splits, tile_n)
DECODE_CASES = [
    (torch.float32, False, 2, 2, 64, 16, 1, 16),
    (torch.float32, False, 6, 2, 64, 32, 4, 32),  # splits 1-3 of the 5-token sequence are empty
    (torch.bfloat16, False, 6, 2, 64, 16, 2, 32),  # a tile spans two blocks
    (torch.float16, False, 8, 1, 64, 16, 1, 64),  # GQA 8
    (torch.float32, True, 6, 2, 64, 16, 1, 16),
    (torch.bfloat16, True, 2, 2, 64, 32, 2, 32),
    (torch.float32, False, 6, 2, 128, 16, 2, 16),
]


@pytest.mark.parametrize("dtype,kv_int8,hq,hkv,head_dim,block_size,num_splits,tile_n", DECODE_CASES)
def test_decode_triton_equals_ref(
    dtype: torch.dtype, kv_int8: bool, hq: int, hkv: int, head_dim: int, block_size: int,
    num_splits: int, tile_n: int,
) -> None:
    b = make_batch(SEQ_LENS, [1, 1, 1], hq, hkv, head_dim, block_size, dtype, kv_int8, device=DEVICE)
    out = paged_decode_attention_triton(
        b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, SCALE, max(SEQ_LENS),
        b.k_scale, b.v_scale, num_splits=num_splits, tile_n=tile_n)
    ref = paged_decode_attention_ref(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                     SCALE, k_scale=b.k_scale, v_scale=b.v_scale)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)
    for i in range(len(SEQ_LENS)):  # and the float64 ground truth
        assert_close(out[i : i + 1], dense_causal_attention(
            b.query[i : i + 1].cpu(), b.dense_k[i], b.dense_v[i], SCALE), dtype)


# (dtype, kv_int8, num_heads, num_kv_heads, head_dim, block_size)
PREFILL_CASES = [
    (torch.float32, False, 2, 2, 64, 16),
    (torch.float32, False, 6, 2, 64, 32),
    (torch.bfloat16, False, 6, 2, 64, 16),
    (torch.float32, True, 6, 2, 64, 16),
    (torch.bfloat16, True, 2, 2, 64, 32),
    (torch.float32, False, 3, 1, 128, 32),
]


@pytest.mark.parametrize("dtype,kv_int8,hq,hkv,head_dim,block_size", PREFILL_CASES)
def test_prefill_triton_equals_ref(
    dtype: torch.dtype, kv_int8: bool, hq: int, hkv: int, head_dim: int, block_size: int
) -> None:
    # cached prefixes of 17 and 67 tokens around a plain prefill; 20 new tokens span two row tiles
    query_lens = [20, 5, 3]
    b = make_batch(SEQ_LENS, query_lens, hq, hkv, head_dim, block_size, dtype, kv_int8, device=DEVICE)
    out = paged_prefill_attention_triton(
        b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc,
        max(query_lens), SCALE, b.k_scale, b.v_scale, block_m=16, block_n=16)
    ref = paged_prefill_attention_ref(b.query, b.k_cache, b.v_cache, b.block_tables, SEQ_LENS,
                                      b.query_start_loc_list, SCALE, b.k_scale, b.v_scale)
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


def test_mixed_batch_through_dispatch_split() -> None:
    # the dispatcher's CUDA path: decodes first, then prefills with re-based query_start_loc
    seq_lens, query_lens = [9, 40, 37, 21], [1, 1, 12, 21]
    b = make_batch(seq_lens, query_lens, 6, 2, 64, 16, torch.float32, device=DEVICE)
    qsl = b.query_start_loc_list
    meta = AttentionMetadata(
        query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, block_tables=b.block_tables,
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64, device=DEVICE), num_decodes=2,
        max_seq_len=max(seq_lens), query_start_loc_list=qsl, seq_lens_list=tuple(seq_lens))
    out = _paged_attention_triton(b.query, b.k_cache, b.v_cache, meta, SCALE, None, None)
    for i in range(len(seq_lens)):
        expected = dense_causal_attention(b.query[qsl[i] : qsl[i + 1]].cpu(), b.dense_k[i], b.dense_v[i], SCALE)
        assert_close(out[qsl[i] : qsl[i + 1]], expected, torch.float32)


def test_wrappers_reject_mismatched_input() -> None:
    b = make_batch([20], [1], 2, 2, 64, 16, torch.float32, device=DEVICE)
    args = (b.k_cache, b.v_cache, b.block_tables, b.seq_lens, SCALE)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention_triton(b.query.to(torch.bfloat16), *args)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention_triton(b.query, b.k_cache, b.v_cache, b.block_tables.long(), b.seq_lens, SCALE)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention_triton(b.query[:, :1].expand(1, 3, 64).contiguous(), *args)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention_triton(b.query, b.k_cache.to(torch.int8), b.v_cache.to(torch.int8),
                                      b.block_tables, b.seq_lens, SCALE)
