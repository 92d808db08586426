"""The dispatcher: CPU tensors take the torch references (int8 KV included, end to end through
write_kv + paged_attention), and importing `kernels` never imports triton."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels.quant import dequantize_int8_ref, quantize_fp8_ref, quantize_int8_ref
from kernels.reference import dense_causal_attention
from kernels.triton_support import use_triton
from tests.kernels.tolerances import assert_close

SCALE = 0.125


def test_import_kernels_does_not_import_triton() -> None:
    code = "import sys, kernels; kernels.quantize_int8; sys.exit('triton' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0


def test_cpu_tensors_never_take_triton() -> None:
    assert not use_triton(torch.zeros(1), torch.zeros(1))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_write_then_attend_mixed_batch(cache_dtype: torch.dtype) -> None:
    """What the engine does per layer: write the new tokens' KV, then attend; 2 decodes and 2
    prefills (one with a cached prefix), GQA 3, block 16."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, bs, num_blocks = 6, 2, 64, 16, 16
    seq_lens, query_lens = [20, 33, 40, 7], [1, 1, 24, 7]
    blocks = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(4, 4, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // bs)
        table[i, :nb] = blocks[used : used + nb].to(torch.int32)
        used += nb
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    scales = (torch.zeros(num_blocks, bs, hkv), torch.zeros(num_blocks, bs, hkv)) if cache_dtype == torch.int8 else (None, None)
    full_k = [torch.randn(n, hkv, d, generator=gen) for n in seq_lens]
    full_v = [torch.randn(n, hkv, d, generator=gen) for n in seq_lens]

    def slots(i: int, positions: range) -> list[int]:
        return [int(table[i, p // bs]) * bs + p % bs for p in positions]

    # the cached part (prefixes, earlier decode steps) was written by earlier steps
    for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
        if n > q:
            idx = torch.tensor(slots(i, range(n - q)))
            kernels.write_kv(full_k[i][: n - q], full_v[i][: n - q], k_cache, v_cache, idx, *scales)
    new_slots = torch.tensor(sum((slots(i, range(n - q, n)) for i, (n, q) in enumerate(zip(seq_lens, query_lens))), []))
    new_k = torch.cat([k[n - q :] for k, n, q in zip(full_k, seq_lens, query_lens)])
    new_v = torch.cat([v[n - q :] for v, n, q in zip(full_v, seq_lens, query_lens)])
    kernels.write_kv(new_k, new_v, k_cache, v_cache, new_slots, *scales)

    qsl = [0, 1, 2, 26, 33]
    query = torch.randn(qsl[-1], hq, d, generator=gen)
    meta = kernels.AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table, slot_mapping=new_slots, num_decodes=2, max_seq_len=max(seq_lens),
        query_start_loc_list=tuple(qsl), seq_lens_list=tuple(seq_lens))
    out = kernels.paged_attention(query, k_cache, v_cache, meta, SCALE, *scales)

    for i in range(4):
        k, v = full_k[i], full_v[i]
        if cache_dtype == torch.int8:  # what the cache holds is the quantized KV
            k, v = dequantize_int8_ref(*quantize_int8_ref(k)), dequantize_int8_ref(*quantize_int8_ref(v))
        expected = dense_causal_attention(query[qsl[i] : qsl[i + 1]], k, v, SCALE)
        assert_close(out[qsl[i] : qsl[i + 1]], expected, torch.float32)


def test_quantize_dispatch_on_cpu_is_the_reference() -> None:
    x = torch.randn(4, 16, 2, 64)
    for got, want in zip(kernels.quantize_int8(x), quantize_int8_ref(x)):
        assert torch.equal(got, want)
    q, s = kernels.quantize_fp8(x)
    q_ref, s_ref = quantize_fp8_ref(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    assert torch.equal(kernels.dequantize_fp8(q, s, torch.float32), q_ref.float() * s_ref.view(-1, 1, 1, 1))
    qi, si = kernels.quantize_int8(x)
    assert kernels.dequantize_int8(qi, si, torch.bfloat16).dtype == torch.bfloat16
