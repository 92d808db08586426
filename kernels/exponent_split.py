"""Exponent split of float tensors: the byte an entropy coder can shrink, apart from the bytes it cannot.

Mental model: a bf16 or float32 word is sign | 8 exponent bits | mantissa. Over KV the exponent
takes a few dozen values (~3 bits of entropy in SmolLM2's KV) and the rest is noise, so the lossless
`zstd` codec (transfer/codec.py) compresses the exponent bytes and ships the rest as is.
`split_exponents(x)` -> (exps [n] uint8, rest [n * (width - 1)] uint8), `merge_exponents` inverts
it bit for bit (float16 words split the same way: their 8 bits after the sign are 5 exponent and 3
mantissa bits). Byte layout (little endian), for a word x of b bits:
    exps[i] = (x >> (b - 9)) & 0xff
    rest[i] = (sign << (b - 9)) | (x & ((1 << (b - 9)) - 1)), in width - 1 bytes
On the CPU the split runs in C (kernels/csrc/cpu_exponent_split.c, one pass at memory speed; torch's
byte-strided copies run at 0.3-0.6 GB/s); the torch functions here are the reference and the path
everywhere else (a CUDA tensor is split on its device; the codec moves host bytes anyway).
"""

from __future__ import annotations

import torch

from kernels import cpu_native

_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32}


def _bits(width: int) -> int:
    if width not in _INT_OF_WIDTH:
        raise ValueError(f"exponent split takes 2- or 4-byte floats, not {width}-byte words")
    return 8 * width


def split_exponents_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exps [n] uint8, rest [n * (width - 1)] uint8) of the float tensor `x` (any shape, row-major)."""
    width = x.element_size()
    b = _bits(width)
    # int64 keeps the shifts free of sign extension whatever the word's top bit
    words = x.contiguous().reshape(-1).view(_INT_OF_WIDTH[width]).to(torch.int64) & ((1 << b) - 1)
    exps = ((words >> (b - 9)) & 0xFF).to(torch.uint8)
    rest = ((words >> 8) & (1 << (b - 9))) | (words & ((1 << (b - 9)) - 1))
    shifts = torch.arange(width - 1, device=x.device) * 8
    rest_bytes = ((rest[:, None] >> shifts) & 0xFF).to(torch.uint8)  # [n, width - 1], little endian
    return exps, rest_bytes.reshape(-1)


def merge_exponents_ref(exps: torch.Tensor, rest: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The flat [n] tensor of `dtype` that `split_exponents_ref` split into `exps` and `rest`."""
    width = torch.empty((), dtype=dtype).element_size()
    b = _bits(width)
    n = exps.numel()
    if rest.numel() != n * (width - 1):
        raise ValueError(f"{rest.numel()} rest bytes for {n} words of {width} bytes")
    shifts = torch.arange(width - 1, device=rest.device) * 8
    r = (rest.reshape(n, width - 1).to(torch.int64) << shifts).sum(dim=1)
    sign = (r >> (b - 9)) & 1
    words = (sign << (b - 1)) | (exps.to(torch.int64) << (b - 9)) | (r & ((1 << (b - 9)) - 1))
    words = torch.where(words >= 1 << (b - 1), words - (1 << b), words)  # back to the signed int's range
    return words.to(_INT_OF_WIDTH[width]).view(dtype)


def split_exponents(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As `split_exponents_ref`, in C for a CPU tensor where the native kernels build."""
    width = x.element_size()
    _bits(width)
    lib = cpu_native.library() if x.device.type == "cpu" else None
    if lib is None:
        return split_exponents_ref(x)
    src = x.contiguous()
    n = src.numel()
    exps = torch.empty(n, dtype=torch.uint8)
    rest = torch.empty(n * (width - 1), dtype=torch.uint8)
    if lib.ferry_exponent_split(src.data_ptr(), n, width, exps.data_ptr(), rest.data_ptr()) != 0:
        return split_exponents_ref(x)
    return exps, rest


def merge_exponents(exps: torch.Tensor, rest: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As `merge_exponents_ref`, in C for CPU tensors where the native kernels build."""
    width = torch.empty((), dtype=dtype).element_size()
    _bits(width)
    n = exps.numel()
    lib = cpu_native.library() if exps.device.type == rest.device.type == "cpu" else None
    if lib is None or rest.numel() != n * (width - 1):
        return merge_exponents_ref(exps, rest, dtype)
    e, r = exps.contiguous(), rest.contiguous()
    out = torch.empty(n, dtype=dtype)
    if lib.ferry_exponent_merge(e.data_ptr(), r.data_ptr(), n, width, out.data_ptr()) != 0:
        return merge_exponents_ref(exps, rest, dtype)
    return out
