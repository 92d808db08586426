"""The native CPU decode-attention kernel (kernels/cpu_native.py) against dense attention and the
torch reference, the dispatcher's use of it, and its fallbacks (disabled, no compiler)."""

from __future__ import annotations

import logging

import pytest
import torch

import kernels.cpu_native as native
from kernels import AttentionMetadata, paged_attention, rms_norm
from kernels.reference import dense_causal_attention, paged_decode_attention_ref, rms_norm_ref
from tests.kernels.paged_kv_data import make_batch
from tests.kernels.tolerances import assert_close

SCALE = 0.125
available = native.library() is not None
needs_native = pytest.mark.skipif(not available, reason="native CPU kernels could not be built here (no C compiler?)")


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size,head_dim", [(4, 4, 16, 64), (6, 2, 32, 64),
                                                                         (9, 3, 16, 128), (3, 1, 16, 80)])
def test_native_decode_equals_dense_and_reference(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                                  block_size: int, head_dim: int) -> None:
    seq_lens = [37, 5, 70, 32, 1]  # partial last blocks, one partial block, an exact multiple, one token
    b = make_batch(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, block_size, dtype)
    out = native.paged_decode_attention_native(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, SCALE)
    assert out is not None and out.dtype == dtype and out.shape == b.query.shape
    for i in range(len(seq_lens)):
        assert_close(out[i : i + 1], dense_causal_attention(b.query[i : i + 1], b.dense_k[i], b.dense_v[i], SCALE),
                     dtype)
    ref = paged_decode_attention_ref(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, SCALE)
    assert_close(out, ref, dtype)


@needs_native
def test_native_decode_declines_what_it_does_not_take() -> None:
    b = make_batch([20, 9], [1, 1], 4, 2, 64, 16, torch.float32)
    args = (b.block_tables, b.seq_lens, SCALE)
    assert native.paged_decode_attention_native(b.query.double(), b.k_cache.double(), b.v_cache.double(), *args) is None
    assert native.paged_decode_attention_native(b.query, b.k_cache, b.v_cache, b.block_tables.long(), b.seq_lens,
                                                SCALE) is None
    too_long = b.seq_lens.clone()
    too_long[0] = b.block_tables.shape[1] * 16 + 1  # past the table: the C side refuses, nothing is read
    assert native.paged_decode_attention_native(b.query, b.k_cache, b.v_cache, b.block_tables, too_long, SCALE) is None


@needs_native
def test_dispatcher_uses_native_for_float_caches_and_reference_for_int8(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = native.paged_decode_attention_native

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr("kernels.dispatch.paged_decode_attention_native", spy)
    for kv_int8 in (False, True):
        b = make_batch([37, 5], [1, 1], 6, 2, 64, 16, torch.float32, kv_int8)
        meta = AttentionMetadata(
            query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, block_tables=b.block_tables,
            slot_mapping=torch.zeros(2, dtype=torch.int64), num_decodes=2, max_seq_len=37,
            query_start_loc_list=b.query_start_loc_list, seq_lens_list=b.seq_lens_list,
        )
        out = paged_attention(b.query, b.k_cache, b.v_cache, meta, SCALE, b.k_scale, b.v_scale)
        for i in range(2):
            assert_close(out[i : i + 1], dense_causal_attention(b.query[i : i + 1], b.dense_k[i], b.dense_v[i], SCALE),
                         torch.float32)
    assert len(calls) == 1  # the float cache only


def test_disabled_or_unbuildable_means_none(monkeypatch: pytest.MonkeyPatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("FERRY_NATIVE_KERNELS", "0")
    assert native.library() is None
    monkeypatch.setenv("FERRY_NATIVE_KERNELS", "1")
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("FERRY_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_native"):
        assert native.library() is None
    assert "unavailable" in caplog.text
    b = make_batch([20], [1], 2, 2, 64, 16, torch.float32)
    assert native.paged_decode_attention_native(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens,
                                                SCALE) is None
    assert not any(p.suffix == ".so" for p in tmp_path.rglob("*"))  # no half-built library left behind


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 100])
def test_native_rms_norm_equals_the_reference(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    out = native.rms_norm_native(x, w, 1e-5)
    want = rms_norm_ref(x, w, 1e-5)
    assert out is not None and out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    else:  # same two roundings; the float32 sum of squares may sum in another order, and a 1-ulp change
        # before the second rounding can become 2 ulps after it, on a tiny share of the elements
        two_ulps = (want.float().abs() * 2**-6).clamp_min(1e-30)
        assert ((out.float() - want.float()).abs() <= two_ulps).all()
        assert (out == want).float().mean() > 0.99
    # a leading batch dim and the dispatcher
    torch.testing.assert_close(rms_norm(x.view(1, rows, 576), w, 1e-5).float(), out.view(1, rows, 576).float(),
                               atol=0, rtol=0)


def test_rms_norm_falls_back_to_the_reference_for_other_dtypes() -> None:
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.rand(16, dtype=torch.float64)
    assert native.rms_norm_native(x, w, 1e-6) is None
    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


@needs_native
def test_fresh_build_into_an_empty_ferry_home(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv("FERRY_HOME", str(tmp_path))
    lib = native.library()
    assert lib is not None
    built = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [p.name for p in built] == ["libferry_cpu.so"]  # no temporary files left behind
    b = make_batch([20, 3], [1, 1], 4, 2, 64, 16, torch.float32)
    out = native.paged_decode_attention_native(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, SCALE)
    assert out is not None
    assert_close(out, paged_decode_attention_ref(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, SCALE),
                 torch.float32)
