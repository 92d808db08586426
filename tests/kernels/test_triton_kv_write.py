"""The triton KV write against the reference: every token lands in its exact slot (bit-equal to the
reference's cache, untouched slots unchanged), for float caches and int8 caches with scales."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import write_kv_ref

pytest.importorskip("triton", reason="triton not installed: only the references are tested")

from kernels.triton_kv_write import write_kv_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _setup(
    src_dtype: torch.dtype, cache_dtype: torch.dtype, num_kv_heads: int, block_size: int
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    num_blocks, head_dim, num_tokens = 5, 64, 23
    gen = torch.Generator().manual_seed(7)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # stale contents that no write produces, so a missed or extra write shows
    k_cache = torch.full(shape, 7).to(cache_dtype)
    v_cache = torch.full(shape, -7).to(cache_dtype)
    scales: list[torch.Tensor | None] = [None, None]
    if cache_dtype == torch.int8:
        scales = [torch.full(shape[:3], -1.0), torch.full(shape[:3], -2.0)]
    tensors = [key, value, k_cache, v_cache, slots]
    return ([t.to(DEVICE) for t in tensors], [s if s is None else s.to(DEVICE) for s in scales])


@pytest.mark.parametrize("src_dtype,cache_dtype,num_kv_heads,block_size", [
    (torch.float32, torch.float32, 2, 16),
    (torch.bfloat16, torch.bfloat16, 3, 32),  # 3 heads: padded to 4 inside the kernel
    (torch.float32, torch.int8, 3, 16),
    (torch.bfloat16, torch.int8, 1, 32),
])
def test_write_kv_triton_equals_ref(
    src_dtype: torch.dtype, cache_dtype: torch.dtype, num_kv_heads: int, block_size: int
) -> None:
    (key, value, k_cache, v_cache, slots), (k_scale, v_scale) = _setup(
        src_dtype, cache_dtype, num_kv_heads, block_size)
    ref = [t.clone() if t is not None else None for t in (k_cache, v_cache, k_scale, v_scale)]
    write_kv_triton(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    write_kv_ref(key, value, ref[0], ref[1], slots, ref[2], ref[3])
    assert torch.equal(k_cache, ref[0]) and torch.equal(v_cache, ref[1])
    if cache_dtype == torch.int8:
        assert torch.equal(k_scale, ref[2]) and torch.equal(v_scale, ref[3])
    # and the reference itself wrote something: the slots changed
    block, offset = slots[0] // block_size, slots[0] % block_size
    assert not torch.equal(ref[0][block, offset], torch.full_like(ref[0][block, offset], 7))


def test_write_kv_triton_int32_slots_and_cast() -> None:
    # fp32 new KV into a bf16 cache: the interpreter truncates where the GPU rounds, so one bf16 step
    (key, value, k_cache, v_cache, slots), _ = _setup(torch.float32, torch.bfloat16, 2, 16)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv_triton(key, value, k_cache, v_cache, slots.to(torch.int32))
    write_kv_ref(key, value, ref_k, ref_v, slots)
    for got, want in ((k_cache, ref_k), (v_cache, ref_v)):
        steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert steps.max() <= 1


def test_write_kv_triton_rejects_bad_input() -> None:
    (key, value, k_cache, v_cache, slots), _ = _setup(torch.float32, torch.float32, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(key, value, k_cache, v_cache, slots[:-1])
    with pytest.raises(ValueError, match="k_scale"):
        write_kv_triton(key, value, k_cache.to(torch.int8), v_cache.to(torch.int8), slots)
    with pytest.raises(ValueError, match="value"):
        write_kv_triton(key, value[:, :1], k_cache, v_cache, slots)
