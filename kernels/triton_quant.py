"""Triton KV (de)quantization: int8 per (token, head), int8 KV blocks (K per channel, V per token,
bf16 scales) and fp8 e4m3 per block, bit-exact with `kernels/quant.py` (same float32 math, same
rounding; see there for the error bounds).

Mental model: these are pure bandwidth kernels, one pass over memory (the fp8 one reads each block
twice, the second time from L2). Two choices keep them bit-exact with torch *and* runnable in the
triton interpreter, which has no libdevice and a wrong fp8 cast:
- round-half-even is `(y + 1.5 * 2^23) - 1.5 * 2^23`: for |y| < 2^22 the float32 sum has no bits
  below the units place, so the hardware rounds y to an integer (IEEE adds are never reassociated
  by triton, no fast-math);
- the fp8 e4m3 byte is built from the float32 bits (round-half-even on the mantissa, the subnormal
  range scaled by 2^9), and decoded the same way. Division is `div_rn` (IEEE) as in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant import FP8_DTYPE
from kernels.triton_support import (
    FLOAT_KV_DTYPES, check_device, check_dtype, check_shape, next_pow2,
)

@triton.jit
def round_half_even(y):
    return (y + 12582912.0) - 12582912.0  # 1.5 * 2^23


@triton.jit
def quantize_rows_int8(x):
    """x [R, D] float32 -> (q [R, D] int8, scale [R] float32); one scale per row."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)  # `/` is approximate on GPU
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x, safe[:, None])
    return int8_codes(y), scale


@triton.jit
def int8_codes(y):
    return tl.minimum(tl.maximum(round_half_even(y), -127.0), 127.0).to(tl.int8)


@triton.jit
def ceil_bf16(s):
    """s float32 >= 0 -> the smallest bfloat16 value >= s, as float32 (exact in bf16)."""
    bits = s.to(tl.int32, bitcast=True)
    return ((bits + 0xFFFF) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _int8_quant_kernel(
    x_ptr,  # [num_rows, D] float, rows contiguous
    q_ptr,  # [num_rows, D] int8
    scale_ptr,  # [num_rows] float32
    num_rows,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D_PAD)
    mask = (rows < num_rows)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_rows_int8(x)
    tl.store(q_ptr + offs, q, mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < num_rows)


@triton.jit
def _int8_dequant_kernel(
    q_ptr,  # [num_rows, D] int8
    scale_ptr,  # [num_rows] float32
    out_ptr,  # [num_rows, D] float
    num_rows,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, D_PAD)
    mask = (rows < num_rows)[:, None] & (cols < D)[None, :]
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    scale = tl.load(scale_ptr + rows, mask=rows < num_rows, other=0.0)
    tl.store(out_ptr + offs, (q * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_block_tile(num_blocks, KV: tl.constexpr, BS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                   BS_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """Offsets of this program's [BS_PAD, D_PAD] tile (one block of one head of K or V) in
    [L, 2, num_blocks, BS, H, D], its mask, and the offsets of its scales: K [L, n, H, D] (one per
    channel), V [L, n, BS, H] (one per token)."""
    lb = tl.program_id(0).to(tl.int64)  # layer * num_blocks + block
    h = tl.program_id(1)
    t = tl.arange(0, BS_PAD)
    d = tl.arange(0, D_PAD)
    mask = (t < BS)[:, None] & (d < D)[None, :]
    base = ((lb // num_blocks * 2 + KV) * num_blocks + lb % num_blocks) * (BS * H * D) + h * D
    offs = base + t[:, None] * (H * D) + d[None, :]
    if KV == 0:
        s_offs = (lb * H + h) * D + d
        s_mask = d < D
    else:
        s_offs = (lb * BS + t) * H + h
        s_mask = t < BS
    return offs, mask, s_offs, s_mask


@triton.jit
def _int8_kv_quant_kernel(
    x_ptr,  # [L, 2, num_blocks, BS, H, D] float, contiguous
    q_ptr,  # [L, 2, num_blocks, BS, H, D] int8
    scale_ptr,  # K: [L, num_blocks, H, D] bf16; V: [L, num_blocks, BS, H] bf16
    num_blocks,
    KV: tl.constexpr,  # 0: K, a scale per channel over the block's tokens; 1: V, one per token
    BS: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BS_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    offs, mask, s_offs, s_mask = _kv_block_tile(num_blocks, KV, BS, H, D, BS_PAD, D_PAD)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [BS_PAD, D_PAD]
    scale = ceil_bf16(tl.math.div_rn(tl.max(tl.abs(x), axis=KV), 127.0))  # [D_PAD] or [BS_PAD]
    safe = tl.where(scale > 0, scale, 1.0)
    if KV == 0:
        y = tl.math.div_rn(x, safe[None, :])
    else:
        y = tl.math.div_rn(x, safe[:, None])
    tl.store(q_ptr + offs, int8_codes(y), mask=mask)
    tl.store(scale_ptr + s_offs, scale.to(scale_ptr.dtype.element_ty), mask=s_mask)


@triton.jit
def _int8_kv_dequant_kernel(
    q_ptr,  # [L, 2, num_blocks, BS, H, D] int8
    scale_ptr,  # K: [L, num_blocks, H, D] bf16; V: [L, num_blocks, BS, H] bf16
    out_ptr,  # [L, 2, num_blocks, BS, H, D] float
    num_blocks,
    KV: tl.constexpr, BS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
    BS_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    offs, mask, s_offs, s_mask = _kv_block_tile(num_blocks, KV, BS, H, D, BS_PAD, D_PAD)
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    scale = tl.load(scale_ptr + s_offs, mask=s_mask, other=0.0).to(tl.float32)
    if KV == 0:
        x = q * scale[None, :]
    else:
        x = q * scale[:, None]
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def encode_e4m3(y):
    """y float32 with |y| <= 448 -> float8_e4m3fn bits as uint8, round-half-even."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)  # sign bit clear
    # normal: keep 3 of 23 mantissa bits, rounding half to even, then rebias the exponent 127 -> 7
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # subnormal (|y| < 2^-6): the code is y / 2^-9 rounded; 8 lands on the smallest normal, 0b1000
    sub = round_half_even(a * 512.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    sign = y.to(tl.int32, bitcast=True) < 0  # the sign bit, so -0.0 -> 0x80 as torch does
    return (code | tl.where(sign, 0x80, 0)).to(tl.uint8)


@triton.jit
def decode_e4m3(code):
    """float8_e4m3fn bits (uint8) -> float32 (the NaN code 0x7f/0xff is never produced here)."""
    c = code.to(tl.int32)
    exp = (c >> 3) & 0xF
    man = c & 0x7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2^-9
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def _fp8_quant_kernel(
    x_ptr,  # [num_blocks, elems] float, contiguous
    q_ptr,  # [num_blocks, elems] uint8 (view of float8_e4m3fn)
    scale_ptr,  # [num_blocks] float32
    elems,
    CHUNK: tl.constexpr,
):
    base = tl.program_id(0).to(tl.int64) * elems
    offs = tl.arange(0, CHUNK)
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, elems, CHUNK):
        x = tl.load(x_ptr + base + start + offs, mask=start + offs < elems, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.math.div_rn(tl.max(amax, axis=0), 448.0)
    safe = tl.where(scale > 0, scale, 1.0)
    for start in range(0, elems, CHUNK):
        mask = start + offs < elems
        x = tl.load(x_ptr + base + start + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, safe), -448.0), 448.0)
        tl.store(q_ptr + base + start + offs, encode_e4m3(y), mask=mask)
    tl.store(scale_ptr + tl.program_id(0), scale)


@triton.jit
def _fp8_dequant_kernel(
    q_ptr,  # [num_blocks, elems] uint8 (view of float8_e4m3fn)
    scale_ptr,  # [num_blocks] float32
    out_ptr,  # [num_blocks, elems] float
    elems,
    CHUNK: tl.constexpr,
):
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    base = tl.program_id(0).to(tl.int64) * elems
    mask = offs < elems
    scale = tl.load(scale_ptr + tl.program_id(0))
    y = decode_e4m3(tl.load(q_ptr + base + offs, mask=mask, other=0))
    tl.store(out_ptr + base + offs, (y * scale).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() else 0


def quantize_int8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float, contiguous -> (q [..., D] int8, scale [...] float32)."""
    check_device(x)
    check_dtype("x", x, FLOAT_KV_DTYPES)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    d, rows = x.shape[-1], _rows(x)
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    block_r = max(1, 4096 // next_pow2(d))
    if rows:
        _int8_quant_kernel[(triton.cdiv(rows, block_r),)](
            x, q, scale, rows, D=d, D_PAD=next_pow2(d), BLOCK_R=block_r)
    return q, scale


def dequantize_int8_triton(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q [..., D] int8, scale [...] float32 -> [..., D] dtype."""
    check_device(q, scale)
    check_dtype("q", q, (torch.int8,))
    check_dtype("scale", scale, (torch.float32,))
    check_shape("scale", scale, tuple(q.shape[:-1]))
    if not (q.is_contiguous() and scale.is_contiguous()):
        raise ValueError("q and scale must be contiguous")
    d, rows = q.shape[-1], _rows(q)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    block_r = max(1, 4096 // next_pow2(d))
    if rows:
        _int8_dequant_kernel[(triton.cdiv(rows, block_r),)](
            q, scale, out, rows, D=d, D_PAD=next_pow2(d), BLOCK_R=block_r)
    return out


def _check_kv_blocks(name: str, t: torch.Tensor) -> None:
    if t.dim() != 6 or t.shape[1] != 2 or not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous [num_layers, 2, num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(t.shape)}")


def _kv_grid(x: torch.Tensor) -> tuple[tuple[int, int], dict[str, int]]:
    """A program per (layer, block) and head, and the tile's constexprs."""
    num_layers, _, num_blocks, bs, h, d = x.shape
    return (num_layers * num_blocks, h), dict(BS=bs, H=h, D=d, BS_PAD=next_pow2(bs), D_PAD=next_pow2(d))


def quantize_int8_kv_triton(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kv [L, 2, n, bs, H, D] float, contiguous -> (q int8 [same], k_scale [L, n, H, D] bf16,
    v_scale [L, n, bs, H] bf16)."""
    check_device(kv)
    check_dtype("kv", kv, FLOAT_KV_DTYPES)
    _check_kv_blocks("kv", kv)
    num_layers, _, n, bs, h, d = kv.shape
    q = torch.empty(kv.shape, dtype=torch.int8, device=kv.device)
    k_scale = torch.empty((num_layers, n, h, d), dtype=torch.bfloat16, device=kv.device)
    v_scale = torch.empty((num_layers, n, bs, h), dtype=torch.bfloat16, device=kv.device)
    if kv.numel():
        grid, consts = _kv_grid(kv)
        for i, scale in enumerate((k_scale, v_scale)):
            _int8_kv_quant_kernel[grid](kv, q, scale, n, KV=i, **consts)
    return q, k_scale, v_scale


def dequantize_int8_kv_triton(
    q: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q [L, 2, n, bs, H, D] int8, k_scale [L, n, H, D] bf16, v_scale [L, n, bs, H] bf16 -> dtype like q."""
    check_device(q, k_scale, v_scale)
    check_dtype("q", q, (torch.int8,))
    _check_kv_blocks("q", q)
    num_layers, _, n, bs, h, d = q.shape
    for name, scale, shape in (("k_scale", k_scale, (num_layers, n, h, d)),
                               ("v_scale", v_scale, (num_layers, n, bs, h))):
        check_dtype(name, scale, (torch.bfloat16,))
        check_shape(name, scale, shape)
        if not scale.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if q.numel():
        grid, consts = _kv_grid(q)
        for i, scale in enumerate((k_scale, v_scale)):
            _int8_kv_dequant_kernel[grid](q, scale, out, n, KV=i, **consts)
    return out


def quantize_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [num_blocks, ...] float, contiguous -> (q float8_e4m3fn [same], scale [num_blocks] f32)."""
    check_device(x)
    check_dtype("x", x, FLOAT_KV_DTYPES)
    if x.dim() < 1 or not x.is_contiguous():
        raise ValueError("x must be contiguous with a leading block dim")
    num_blocks = x.shape[0]
    elems = x.numel() // max(num_blocks, 1)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(num_blocks, dtype=torch.float32, device=x.device)
    if num_blocks and elems:
        chunk = min(4096, next_pow2(elems))
        _fp8_quant_kernel[(num_blocks,)](x, q.view(torch.uint8), scale, elems, CHUNK=chunk)
    elif num_blocks:
        scale.zero_()
    return q, scale


def dequantize_fp8_triton(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q [num_blocks, ...] float8_e4m3fn, scale [num_blocks] float32 -> [num_blocks, ...] dtype."""
    check_device(q, scale)
    check_dtype("q", q, (FP8_DTYPE,))
    check_dtype("scale", scale, (torch.float32,))
    check_shape("scale", scale, (q.shape[0],))
    if not (q.is_contiguous() and scale.is_contiguous()):
        raise ValueError("q and scale must be contiguous")
    num_blocks = q.shape[0]
    elems = q.numel() // max(num_blocks, 1)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if num_blocks and elems:
        chunk = min(4096, next_pow2(elems))
        _fp8_dequant_kernel[(num_blocks, triton.cdiv(elems, chunk))](
            q.view(torch.uint8), scale, out, elems, CHUNK=chunk)
    return out
