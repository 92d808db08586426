"""Quantization: the references against hand-written math (numpy float32 for int8, the e4m3 grid
enumerated from its bit layout for fp8), the documented round-trip bounds, and the triton kernels
bit-exact against the references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.quant import (
    FP8_DTYPE, ceil_bf16, dequantize_fp8_ref, dequantize_int8_kv_ref, dequantize_int8_ref, quantize_fp8_ref,
    quantize_int8_kv_ref, quantize_int8_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _wide_range(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # magnitudes over ~8 decades, so fp8 groups reach the subnormal range; one all-zero row/block
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp(torch.empty(shape).uniform_(-9, 9, generator=gen))
    x[0] = 0.0
    return x


def _e4m3_grid() -> np.ndarray:
    # every finite float8_e4m3fn value, in code order 0..126 (127 is NaN); positives only
    vals = []
    for code in range(127):
        exp, man = code >> 3, code & 7
        vals.append(man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return np.array(vals)


def test_int8_ref_equals_numpy_math() -> None:
    x = _wide_range((7, 3, 64), seed=0)
    q, scale = quantize_int8_ref(x)
    xn = x.numpy().astype(np.float32)
    for idx in np.ndindex(*xn.shape[:-1]):
        row = xn[idx]
        s = np.float32(np.abs(row).max()) / np.float32(127)
        want = np.zeros_like(row) if s == 0 else np.clip(np.rint(row / s), -127, 127)
        assert scale[idx].item() == s
        assert np.array_equal(q[idx].numpy(), want.astype(np.int8))


def test_ceil_bf16_is_the_next_bf16_up() -> None:
    x = torch.cat([_wide_range((1000,), seed=6).abs(), torch.tensor([0.0, 1.0, 1.0 + 2.0**-8, 3.0e38])])
    up = ceil_bf16(x)
    assert torch.equal(up.bfloat16().float(), up)  # a bf16 value
    assert (up >= x).all()
    below = torch.nextafter(up.bfloat16(), torch.tensor(0.0, dtype=torch.bfloat16)).float()
    assert ((below < x) | (x == 0)).all()  # the next bf16 down is already below x: the smallest one
    assert (up[x > 0] / x[x > 0]).max() <= 1 + 2.0**-7
    assert ceil_bf16(torch.tensor([1.0 + 2.0**-8])).item() == 1.0 + 2.0**-7


def _kv_blocks(seed: int, shape: tuple[int, ...] = (2, 2, 3, 5, 3, 24)) -> torch.Tensor:
    """[L, 2, n, bs, H, D], odd sizes; K with two outlier channels, one all-zero block."""
    x = _wide_range(shape, seed)
    x[:, 0, ..., :2] *= 50.0
    x[1, :, 2] = 0.0
    return x


def test_int8_kv_ref_equals_numpy_math() -> None:
    kv = _kv_blocks(seed=7)
    q, k_scale, v_scale = quantize_int8_kv_ref(kv)
    assert k_scale.dtype == v_scale.dtype == torch.bfloat16
    xn = kv.numpy().astype(np.float32)

    def codes(x: np.ndarray, s: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(x / np.where(s > 0, s, 1)), -127, 127).astype(np.int8)

    def scale(amax: np.ndarray) -> np.ndarray:
        # amax / 127 rounded up to bf16: the float32 bits with the low 16 cleared, plus one bf16 step if any were set
        bits = (amax / np.float32(127)).astype(np.float32).view(np.uint32)
        return ((bits & 0xFFFF0000) + np.where(bits & 0xFFFF, 0x10000, 0)).astype(np.uint32).view(np.float32)

    k, v = xn[:, 0], xn[:, 1]  # [L, n, bs, H, D]
    ks = scale(np.abs(k).max(axis=2))  # [L, n, H, D]: over the block's tokens
    vs = scale(np.abs(v).max(axis=-1))  # [L, n, bs, H]: over head_dim
    assert np.array_equal(k_scale.float().numpy(), ks) and np.array_equal(v_scale.float().numpy(), vs)
    assert np.array_equal(q[:, 0].numpy(), codes(k, ks[:, :, None]))
    assert np.array_equal(q[:, 1].numpy(), codes(v, vs[..., None]))


def test_int8_kv_round_trip_within_bound() -> None:
    kv = _kv_blocks(seed=8, shape=(3, 2, 4, 16, 2, 64))
    q, k_scale, v_scale = quantize_int8_kv_ref(kv)
    err = (kv - dequantize_int8_kv_ref(q, k_scale, v_scale)).abs()
    s = torch.stack((k_scale.float().unsqueeze(2).expand_as(kv[:, 0]),
                     v_scale.float().unsqueeze(-1).expand_as(kv[:, 1])), dim=1)
    bound = s * (0.5 + 2.0**-15)
    assert (err <= bound).all()
    assert (q[1, :, 2] == 0).all() and (k_scale[1, 2] == 0).all() and (v_scale[1, 2] == 0).all()
    assert (err / bound.clamp_min(1e-30)).max() > 0.95  # tight: half a step is reached
    assert dequantize_int8_kv_ref(q, k_scale, v_scale, torch.bfloat16).dtype == torch.bfloat16


def test_fp8_ref_equals_nearest_grid_value() -> None:
    x = _wide_range((5, 16, 2, 8), seed=1)
    q, scale = quantize_fp8_ref(x)
    grid = _e4m3_grid()
    for b in range(x.shape[0]):
        s = np.float32(np.abs(x[b].numpy()).max()) / np.float32(448)
        assert scale[b].item() == s
        y = (x[b].numpy() / (s if s > 0 else np.float32(1))).astype(np.float32).ravel().astype(np.float64)
        dist = np.abs(np.abs(y)[:, None] - grid[None, :])
        best = dist.min(axis=1, keepdims=True)
        # nearest value; on a tie the even code (even last mantissa bit)
        ties = dist == best
        code = np.where(ties.sum(1) > 1, np.argmax(ties & (np.arange(127) % 2 == 0), 1), np.argmin(dist, 1))
        want = np.where(np.signbit(y), -grid[code], grid[code])
        assert np.array_equal(q[b].float().numpy().ravel(), want.astype(np.float32))


def test_int8_round_trip_within_bound() -> None:
    x = _wide_range((50, 4, 128), seed=2)
    q, scale = quantize_int8_ref(x)
    err = (x - dequantize_int8_ref(q, scale)).abs()
    bound = scale.unsqueeze(-1) * (0.5 + 2.0**-15)
    assert (err <= bound).all()
    assert (q[0] == 0).all() and (scale[0] == 0).all()
    # the bound is tight (half a step is reached), so a coarser rounding would fail it
    assert (err / bound.clamp_min(1e-30)).max() > 0.95


def test_fp8_round_trip_within_bound() -> None:
    x = _wide_range((40, 16, 2, 64), seed=3)
    q, scale = quantize_fp8_ref(x)
    assert q.dtype == FP8_DTYPE and not torch.isnan(q.float()).any()
    err = (x - dequantize_fp8_ref(q, scale)).abs()
    s = scale.view(-1, 1, 1, 1)
    bound = 2.0**-4 * x.abs() + 2.0**-10 * s
    assert (err <= bound).all()
    assert (scale[0] == 0).all() and (q[0].float() == 0).all()
    # both terms bind somewhere: normal values reach ~2^-4 relative, subnormals ~2^-10 * scale
    normal = (x.abs() >= 2.0**-6 * s) & (x != 0)
    assert (err[normal] / x.abs()[normal]).max() > 0.9 * 2.0**-4
    assert (err[~normal & (x != 0)] / s.expand_as(x)[~normal & (x != 0)]).max() > 0.9 * 2.0**-10


def _ties() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs exactly halfway between two codes (scale 1: amax is 127 / 448), and the
    round-half-to-even answers."""
    i8 = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] + [0.0] * 8])
    i8_want = torch.tensor([[127, 0, 2, 2, 0, -2, -2, 126] + [0] * 8], dtype=torch.int8)
    # e4m3 near 1: step 1/8 (1.0625 -> 1.0, 1.1875 -> 1.25); subnormal step 2^-9; top step 32
    f8 = torch.tensor([[448.0, 1.0625, 1.1875, -1.0625, 3 * 2.0**-10, 2.0**-10, 7.5 * 2.0**-9, 432.0]])
    f8_want = torch.tensor([[448.0, 1.0, 1.25, -1.0, 2 * 2.0**-9, 0.0, 8 * 2.0**-9, 448.0]])
    return i8, i8_want, f8, f8_want


def test_ref_ties_round_half_to_even() -> None:
    i8, i8_want, f8, f8_want = _ties()
    q, scale = quantize_int8_ref(i8)
    assert scale.item() == 1.0 and torch.equal(q, i8_want)
    q8, scale8 = quantize_fp8_ref(f8)
    assert scale8.item() == 1.0 and torch.equal(q8.float(), f8_want)


def test_dequantize_casts_to_requested_dtype() -> None:
    q, scale = quantize_int8_ref(torch.randn(3, 64))
    assert dequantize_int8_ref(q, scale, torch.bfloat16).dtype == torch.bfloat16
    q8, s8 = quantize_fp8_ref(torch.randn(2, 16, 1, 64))
    assert dequantize_fp8_ref(q8, s8, torch.float16).dtype == torch.float16


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    # distance in representable bf16 steps (same sign assumed, as here)
    return int((a.view(torch.int16).int() - b.view(torch.int16).int()).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_triton_equals_ref(dtype: torch.dtype) -> None:
    pytest.importorskip("triton", reason="triton not installed")
    from kernels.triton_quant import dequantize_int8_triton, quantize_int8_triton

    x = _wide_range((9, 3, 64), seed=4).to(dtype).to(DEVICE)
    q, scale = quantize_int8_triton(x)
    q_ref, scale_ref = quantize_int8_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    assert torch.equal(dequantize_int8_triton(q, scale), dequantize_int8_ref(q, scale))
    # the interpreter truncates float32 -> bf16 where torch rounds: at most one bf16 step apart
    assert _bf16_ulps(dequantize_int8_triton(q, scale, torch.bfloat16),
                      dequantize_int8_ref(q, scale, torch.bfloat16)) <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_triton_equals_ref(dtype: torch.dtype) -> None:
    pytest.importorskip("triton", reason="triton not installed")
    from kernels.triton_quant import dequantize_fp8_triton, quantize_fp8_triton

    x = _wide_range((5, 16, 3, 64), seed=5).to(dtype)
    x[1, 0, 0, :4] = -0.0  # negative zero keeps its sign bit, as in torch
    x = x.to(DEVICE)
    q, scale = quantize_fp8_triton(x)
    q_ref, scale_ref = quantize_fp8_ref(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(dequantize_fp8_triton(q, scale), dequantize_fp8_ref(q, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_kv_triton_equals_ref(dtype: torch.dtype) -> None:
    pytest.importorskip("triton", reason="triton not installed")
    from kernels.triton_quant import dequantize_int8_kv_triton, quantize_int8_kv_triton

    kv = _kv_blocks(seed=9).to(dtype).to(DEVICE)
    q, k_scale, v_scale = quantize_int8_kv_triton(kv)
    q_ref, k_ref, v_ref = quantize_int8_kv_ref(kv)
    assert torch.equal(q, q_ref) and torch.equal(k_scale, k_ref) and torch.equal(v_scale, v_ref)
    assert torch.equal(dequantize_int8_kv_triton(q, k_scale, v_scale), dequantize_int8_kv_ref(q, k_scale, v_scale))
    assert _bf16_ulps(dequantize_int8_kv_triton(q, k_scale, v_scale, torch.bfloat16),
                      dequantize_int8_kv_ref(q, k_scale, v_scale, torch.bfloat16)) <= 1


def test_triton_ties_round_half_to_even() -> None:
    pytest.importorskip("triton", reason="triton not installed")
    from kernels.triton_quant import quantize_fp8_triton, quantize_int8_triton

    i8, i8_want, f8, f8_want = (t.to(DEVICE) for t in _ties())
    assert torch.equal(quantize_int8_triton(i8)[0], i8_want)
    assert torch.equal(quantize_fp8_triton(f8)[0].float(), f8_want)


def test_triton_quant_rejects_bad_input() -> None:
    pytest.importorskip("triton", reason="triton not installed")
    from kernels.triton_quant import dequantize_int8_triton, quantize_int8_triton

    with pytest.raises(ValueError, match="contiguous"):
        quantize_int8_triton(torch.randn(64, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="scale"):
        dequantize_int8_triton(torch.zeros(4, 64, dtype=torch.int8, device=DEVICE),
                               torch.zeros(5, device=DEVICE))


def test_triton_int8_kv_rejects_bad_input() -> None:
    pytest.importorskip("triton", reason="triton not installed")
    from kernels.triton_quant import dequantize_int8_kv_triton, quantize_int8_kv_triton

    with pytest.raises(ValueError, match="num_layers, 2"):
        quantize_int8_kv_triton(torch.randn(2, 3, 1, 4, 2, 16, device=DEVICE))
    q = torch.zeros(2, 2, 1, 4, 2, 16, dtype=torch.int8, device=DEVICE)
    k_scale, v_scale = torch.zeros(2, 1, 2, 16, device=DEVICE), torch.zeros(2, 1, 4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale: dtype"):
        dequantize_int8_kv_triton(q, k_scale, v_scale.bfloat16())
    with pytest.raises(ValueError, match="v_scale: shape"):
        dequantize_int8_kv_triton(q, k_scale.bfloat16(), v_scale.bfloat16()[:, :, :3])
