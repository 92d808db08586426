"""Production-sized shapes on a real GPU (skipped without CUDA): long contexts with the automatic
split count, GQA 4 and 8, head dim 128, bf16 and int8 KV, a prefill with long cached prefixes, and
the quantizers bit-exact on large tensors. Tolerances: tests/kernels/tolerances.py."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import dequantize_fp8_ref, quantize_fp8_ref, quantize_int8_ref
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv_ref
from tests.kernels.paged_kv_data import make_batch
from tests.kernels.tolerances import assert_close

pytestmark = pytest.mark.gpu
SCALE = 128**-0.5


@pytest.mark.parametrize("seq_lens,hq,hkv,kv_int8", [
    ([32768], 32, 8, False),  # batch 1 at 32k: 8 (seq, kv head) pairs, so many splits
    ([32749], 32, 8, True),
    ([8191, 77, 4096, 1, 6000, 3333, 8192, 15] * 2, 64, 8, False),  # GQA 8, ragged, length 1
    ([1000 + 37 * i for i in range(64)], 32, 8, True),
])
def test_decode_large(seq_lens: list[int], hq: int, hkv: int, kv_int8: bool) -> None:
    from kernels.triton_decode import paged_decode_attention_triton

    b = make_batch(seq_lens, [1] * len(seq_lens), hq, hkv, 128, 16, torch.bfloat16, kv_int8, device="cuda")
    out = paged_decode_attention_triton(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                        SCALE, max(seq_lens), b.k_scale, b.v_scale)
    ref = paged_decode_attention_ref(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, SCALE,
                                     k_scale=b.k_scale, v_scale=b.v_scale)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("kv_int8", [False, True])
def test_prefill_large(kv_int8: bool) -> None:
    from kernels.triton_prefill import paged_prefill_attention_triton

    seq_lens, query_lens = [4000, 1500, 9000, 700], [1000, 1500, 513, 1]
    b = make_batch(seq_lens, query_lens, 32, 8, 128, 16, torch.bfloat16, kv_int8, device="cuda")
    out = paged_prefill_attention_triton(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                         b.query_start_loc, max(query_lens), SCALE, b.k_scale, b.v_scale)
    ref = paged_prefill_attention_ref(b.query, b.k_cache, b.v_cache, b.block_tables, seq_lens,
                                      b.query_start_loc_list, SCALE, b.k_scale, b.v_scale)
    assert_close(out, ref, torch.bfloat16)


def test_quant_and_write_large_bit_exact() -> None:
    from kernels.triton_kv_write import write_kv_triton
    from kernels.triton_quant import dequantize_fp8_triton, quantize_fp8_triton, quantize_int8_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 16, 8, 128, device="cuda", generator=gen, dtype=torch.bfloat16) * 3
    q, s = quantize_int8_triton(x)
    q_ref, s_ref = quantize_int8_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    q8, s8 = quantize_fp8_triton(x)
    q8_ref, s8_ref = quantize_fp8_ref(x)
    assert torch.equal(s8, s8_ref) and torch.equal(q8.view(torch.uint8), q8_ref.view(torch.uint8))
    assert torch.equal(dequantize_fp8_triton(q8, s8, torch.bfloat16), dequantize_fp8_ref(q8, s8, torch.bfloat16))

    k_cache = torch.zeros(512, 16, 8, 128, device="cuda", dtype=torch.int8)
    k_scale = torch.zeros(512, 16, 8, device="cuda")
    caches = [k_cache, k_cache.clone(), k_scale, k_scale.clone()]
    ref = [t.clone() for t in caches]
    slots = torch.randperm(512 * 16, device="cuda")[:3000]
    new = x.view(-1, 8, 128)[:3000]
    write_kv_triton(new, new, *caches[:2], slots, *caches[2:])
    write_kv_ref(new, new, *ref[:2], slots, *ref[2:])
    assert all(torch.equal(a, b) for a, b in zip(caches, ref))
