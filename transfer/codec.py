"""One request's KV, as shards that cross process boundaries: quantize, split by layer groups, checksum.

Mental model: the sender holds `kv = runner.read_blocks(block_ids)`, shaped
[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]. `encode` cuts it into `num_shards`
contiguous layer groups and turns each into one self-describing byte string (header.py: magic,
version, layout id, dtype, compression, shapes, layer range, shard index/count, block hashes,
crc32). The receiver `decode_shard`s each one as it lands and writes it at once with
`runner.write_blocks(block_ids, d.kv, layers=d.layers)`, while later shards are still in flight.
Nothing is pickled: a shard is a header and raw little-endian tensor bytes.

Compression and its documented error (x is the original value, x̂ what `decode_shard` returns; the
quantizers are kernels/'s, run on the KV's device, and these restate kernels/quant.py's bounds;
`error_bound` computes them):
- `none`: bit-exact.
- `int8` (format version 2): K with one bf16 scale per (layer, block, head, channel) over the
  block's tokens, V with one per (layer, block, token, head) over head_dim; s is amax/127 rounded
  up to bf16: |x - x̂| <= s * (1/2 + 2^-15). Bytes per block and head: 2 * bs * D + 2 * D + 2 * bs,
  0.54x of bf16 at bs 16, D 64. On SmolLM2 in float32, per-channel K scales halve the KL divergence
  of the next-token distribution that per-token ones cause (bench/transfer.py). Version 1 had one
  float32 scale per (token, head) for K and V alike.
- `fp8` (e4m3): one float32 scale s = amax/448 per (layer, k|v, block): |x - x̂| <= 2^-4 |x| + 2^-10 s.
  Bytes: ~0.5x of bf16.
Both quantized modes then round x̂ to the KV dtype, which adds at most half an ulp of x̂ (2^-8 |x̂|
for bf16, 2^-11 for fp16, 2^-24 for float32).
- `zstd` (lossless, bit-exact like none): each word's 8 bits after the sign (the exponent: a few
  dozen values over KV, ~3 bits of entropy) are split out (kernels/exponent_split.py) and
  compressed with zstd level 1; the sign and mantissa bytes, noise to any compressor, are stored
  as they are. Payload: rest bytes (n * (width - 1)), padding to 8, then one zstd frame of the n
  exponent bytes. On SmolLM2's KV: ~1.45x fewer bytes in bfloat16, ~1.2x in float32
  (bench/transfer.py --parts lossless). Host only: a CUDA shard is encoded with a GPU codec.
`LOSSLESS` names the codecs whose decode returns the sender's bits; the others are lossy.

Device shards (for transports that move GPU memory: cuda_ipc, NIXL with VRAM staging):
`encode(kv, ..., device="cuda:0")` returns uint8 tensors on that GPU, quantized there, and
`decode_shard` takes such a tensor and returns its KV on the shard's device, dequantized there. The
KV payload itself never goes through the host, with one exception, the crc32 (zlib, host only):
- `encode` copies each device shard's payload to the host once to compute its checksum;
- `decode_shard(..., verify=True)`, the default, does the same to check it; `verify=False` skips
  the checksum (and that copy) for a payload that only crossed one node's GPU memory.
Apart from that only the header (`header_len` bytes, read before the payload) crosses to the host.
"""

from __future__ import annotations

import enum
import hashlib
import math
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import zstandard

from kernels import dequantize_fp8, dequantize_int8_kv, quantize_fp8, quantize_int8_kv
from kernels.exponent_split import merge_exponents, split_exponents
from kernels.quant import ceil_bf16
from transfer import header
from transfer.header import ShardHeader
from transfer.transport import Buffer, CorruptShard, IncompatiblePeer, as_bytes_view, is_tensor


class Compression(enum.IntEnum):
    NONE = 0
    INT8 = 1
    FP8 = 2
    ZSTD = 3

    @classmethod
    def parse(cls, name: "str | Compression") -> "Compression":
        if isinstance(name, Compression):
            return name
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown compression {name!r}; choose one of "
                             f"{', '.join(c.name.lower() for c in cls)}") from None

    @property
    def lossless(self) -> bool:
        """Decoding returns the sender's bits exactly."""
        return self in LOSSLESS


LOSSLESS = frozenset({Compression.NONE, Compression.ZSTD})
HOST_ONLY = frozenset({Compression.ZSTD})  # no device shards: the compressor runs on the host
ZSTD_LEVEL = 1  # bench/transfer.py --parts lossless: level 1 beats 3 and the negative levels on ratio and speed
_zstd = threading.local()  # zstd contexts are not thread-safe: one per thread


def _zstd_compress(data: torch.Tensor) -> bytes:
    if not hasattr(_zstd, "c"):
        _zstd.c = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return _zstd.c.compress(memoryview(data.numpy()))


def _zstd_decompress(frame: memoryview, size: int) -> bytes:
    if not hasattr(_zstd, "d"):
        _zstd.d = zstandard.ZstdDecompressor()
    try:
        out = _zstd.d.decompress(frame, max_output_size=size)
    except zstandard.ZstdError as e:
        raise CorruptShard(f"zstd frame does not decompress: {e}") from None
    if len(out) != size:
        raise CorruptShard(f"zstd frame holds {len(out)} exponent bytes, expected {size}")
    return out


_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_HALF_ULP = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
_PAD = 8  # scales follow the quantized values at an 8-byte boundary, so they can be viewed in place


@dataclass(frozen=True)
class KVLayout:
    """What must match between sender and receiver for KV to be reusable as is."""

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def layout_id(self) -> int:
        key = f"{self.model}|{self.num_layers}|{self.num_kv_heads}|{self.head_dim}|{self.block_size}"
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


@dataclass(frozen=True)
class DecodedShard:
    header: ShardHeader
    kv: torch.Tensor  # [layer_end - layer_start, 2, num_blocks, block_size, num_kv_heads, head_dim]

    @property
    def layers(self) -> range:
        return self.header.layers


def layer_groups(num_layers: int, num_shards: int) -> list[range]:
    """Contiguous layer ranges of near-equal size, the larger ones first."""
    if not 1 <= num_shards <= num_layers:
        raise ValueError(f"num_shards must be in [1, {num_layers}], got {num_shards}")
    base, extra = divmod(num_layers, num_shards)
    groups, start = [], 0
    for i in range(num_shards):
        end = start + base + (1 if i < extra else 0)
        groups.append(range(start, end))
        start = end
    return groups


# The quantizers run where the KV is (kernels/ dispatches: triton on CUDA, torch reference on CPU),
# so on a GPU only the compressed bytes cross PCIe.
def _quantize(x: torch.Tensor, c: Compression) -> tuple[torch.Tensor, ...]:
    """-> (q like x, its scales): int8 K [L, n, H, D] and V [L, n, bs, H]; fp8 [L * 2 * n];
    zstd: (rest bytes, the zstd frame of the exponent bytes), both flat uint8 on the host."""
    if c is Compression.ZSTD:
        exps, rest = split_exponents(x.cpu())
        with warnings.catch_warnings():  # read-only bytes: encode only copies them into the shard
            warnings.simplefilter("ignore", UserWarning)
            return rest, torch.frombuffer(_zstd_compress(exps), dtype=torch.uint8)
    if c is Compression.INT8:
        return quantize_int8_kv(x)
    nl, two, n = x.shape[:3]
    q, scale = quantize_fp8(x.reshape(nl * two * n, *x.shape[3:]))  # one scale per block
    return q.reshape(x.shape), scale


def _scale_shapes(c: Compression, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    nl, _, n, bs, h, d = shape
    return [(nl, n, h, d), (nl, n, bs, h)] if c is Compression.INT8 else [(nl * 2 * n,)]


def _dequantize(q: torch.Tensor, scales: list[torch.Tensor], c: Compression, dtype: torch.dtype) -> torch.Tensor:
    if c is Compression.INT8:
        return dequantize_int8_kv(q, *scales, dtype)
    nl, two, n = q.shape[:3]
    return dequantize_fp8(q.reshape(nl * two * n, *q.shape[3:]), scales[0], dtype).reshape(q.shape)


def _padded(n: int) -> int:
    return (n + _PAD - 1) // _PAD * _PAD


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def encode(
    kv: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    layout: KVLayout,
    *,
    compression: Compression | str = Compression.NONE,
    num_shards: int = 1,
    block_hashes: Sequence[int] = (),
    transfer_id: int = 0,
    device: torch.device | str | None = None,
) -> list[bytearray] | list[torch.Tensor]:
    """Shards of one request's KV, one per layer group, in layer order: host bytearrays, or with
    `device` uint8 tensors there (quantized on the KV's device either way; see the module notes)."""
    c = Compression.parse(compression)
    L, two, n, bs, H, D = kv.shape
    if (L, two, bs, H, D) != (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim):
        raise ValueError(f"KV of shape {tuple(kv.shape)} does not match {layout}")
    if kv.dtype not in _DTYPE_CODES or n == 0:
        raise ValueError(f"cannot encode {n} blocks of {kv.dtype}; dtypes: {sorted(map(str, _DTYPE_CODES))}")
    hashes = tuple(int(h) for h in block_hashes) or (0,) * n
    if len(hashes) != n:
        raise ValueError(f"{len(hashes)} block hashes for {n} blocks")
    kv = kv.detach()
    out_device = None if device is None else torch.device(device)
    if out_device is not None and c in HOST_ONLY:
        raise ValueError(f"{c.name.lower()} is a host codec; device shards take none, int8 or fp8")
    shards: list = []
    for i, layers in enumerate(layer_groups(L, num_shards)):
        part = kv[layers.start : layers.stop]
        pieces = [_bytes_of(t) for t in ((part,) if c is Compression.NONE else _quantize(part, c))]
        if out_device is None:
            pieces = [p.cpu() for p in pieces]
        sizes = [_padded(p.numel()) for p in pieces[:-1]] + [pieces[-1].numel()]
        h = ShardHeader(
            layout_id=layout.layout_id, transfer_id=transfer_id, raw_bytes=part.numel() * part.element_size(),
            payload_bytes=sum(sizes), num_blocks=n, block_size=bs, num_layers=L, layer_start=layers.start,
            layer_end=layers.stop, shard_index=i, num_shards=num_shards, num_kv_heads=H, head_dim=D,
            dtype=_DTYPE_CODES[kv.dtype], compression=int(c), block_hashes=hashes,
        )
        if out_device is not None:
            shards.append(_device_shard(h, pieces, sizes, out_device))
            continue
        out = bytearray(h.header_len + h.payload_bytes)
        view = memoryview(out)
        header.pack_into(view, h)
        at = h.header_len
        for piece, size in zip(pieces, sizes):
            torch.frombuffer(out, dtype=torch.uint8, count=piece.numel(), offset=at).copy_(piece)
            at += size
        header.seal(view)
        shards.append(out)
    return shards


def _device_shard(h: ShardHeader, pieces: list[torch.Tensor], sizes: list[int], device: torch.device) -> torch.Tensor:
    """One shard as a uint8 tensor on `device`: pieces copied in place there, the header from the host."""
    out = torch.empty(h.header_len + h.payload_bytes, dtype=torch.uint8, device=device)
    at = h.header_len
    for piece, size in zip(pieces, sizes):
        out[at : at + piece.numel()].copy_(piece)
        out[at + piece.numel() : at + size].zero_()  # padding: the checksum covers it
        at += size
    head = bytearray(h.header_len)
    header.pack_into(memoryview(head), h)
    # The one host copy of the payload on this side: zlib's crc32 runs on the host.
    header.seal_split(memoryview(head), memoryview(out[h.header_len :].cpu().numpy()))
    out[: h.header_len].copy_(torch.frombuffer(head, dtype=torch.uint8))
    return out


def _unpack_device(shard: torch.Tensor, verify: bool) -> ShardHeader:
    """Header of a uint8 tensor shard: the header bytes, and only they unless `verify`, read to the host."""
    if shard.dtype != torch.uint8 or shard.dim() != 1:
        raise ValueError(f"a tensor shard is a flat uint8 tensor, not {shard.dtype} of shape {tuple(shard.shape)}")
    hlen = header.header_len_of(memoryview(shard[: header.PREFIX_BYTES].cpu().numpy()))
    head = memoryview(shard[: max(header.PREFIX_BYTES, min(hlen, shard.numel()))].cpu().numpy())
    if not verify:
        return header.unpack_head(head, shard.numel(), None)
    return header.unpack_head(head, shard.numel(), lambda: header.crc_split(head, memoryview(shard[hlen:].cpu().numpy())))


def _view(shard: memoryview, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    count = math.prod(shape) * dtype.itemsize
    with warnings.catch_warnings():  # a read-only buffer is fine: decode never writes into it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(shard, dtype=torch.uint8, count=count, offset=offset)
    return raw.view(dtype).reshape(shape)


def decode_shard(shard: Buffer, layout: KVLayout, device: torch.device | str | None = None, *,
                 verify: bool = True) -> DecodedShard:
    """Validates one shard against `layout` and returns its KV in the sender's dtype, on `device`
    (dequantized there; default: where the shard is, CPU for host bytes). With `none` and no
    device change the tensor is a view into `shard`: write it into the pool before releasing the
    buffer. `verify=False` skips the checksum (for a device shard: its one host copy)."""
    tensor = shard if is_tensor(shard) else None
    if tensor is not None:
        h = _unpack_device(tensor, verify)
        device = tensor.device if device is None else device
    else:
        view = as_bytes_view(shard)
        h = header.unpack(view) if verify else header.unpack_head(view, len(view), None)
    if h.layout_id != layout.layout_id:
        raise IncompatiblePeer(f"peer's KV layout id {h.layout_id:#x} is not ours ({layout.layout_id:#x}: {layout})")
    if h.dtype not in _CODE_DTYPES or h.compression not in {int(m) for m in Compression}:
        raise IncompatiblePeer(f"unknown dtype code {h.dtype} or compression code {h.compression}")
    c, dtype = Compression(h.compression), _CODE_DTYPES[h.dtype]
    shape = (len(h.layers), 2, h.num_blocks, h.block_size, h.num_kv_heads, h.head_dim)
    at = h.header_len
    if c is Compression.ZSTD:
        payload = memoryview(tensor[at:].cpu().numpy()) if tensor is not None else view[at:]
        kv = _decode_zstd(payload, h.payload_bytes, dtype, shape)
        return DecodedShard(h, kv if device is None else kv.to(device))
    if c is Compression.NONE:
        pieces = [(dtype, shape)]
    else:
        sdtype = torch.bfloat16 if c is Compression.INT8 else torch.float32
        qdtype = torch.int8 if c is Compression.INT8 else torch.float8_e4m3fn
        pieces = [(qdtype, shape)] + [(sdtype, s) for s in _scale_shapes(c, shape)]
    sizes = [math.prod(s) * d.itemsize for d, s in pieces]
    expect = sum(map(_padded, sizes[:-1])) + sizes[-1]
    if h.payload_bytes != expect:
        raise CorruptShard(f"payload of {h.payload_bytes} bytes, expected {expect} for {shape} {c.name}")
    tensors = []
    for (d, s), size in zip(pieces, sizes):
        t = tensor[at : at + size].view(d).reshape(s) if tensor is not None else _view(view, at, d, s)
        tensors.append(t if device is None else t.to(device))
        at += _padded(size)
    if c is Compression.NONE:
        return DecodedShard(h, tensors[0])
    return DecodedShard(h, _dequantize(tensors[0], tensors[1:], c, dtype))


def _decode_zstd(payload: memoryview, payload_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A zstd shard's payload (rest bytes, padding, exponent frame) -> its KV on the host."""
    n = math.prod(shape)
    rest_bytes = n * (dtype.itemsize - 1)
    if payload_bytes <= _padded(rest_bytes):
        raise CorruptShard(f"zstd payload of {payload_bytes} bytes leaves no room for the exponents of {shape}")
    with warnings.catch_warnings():  # a read-only buffer is fine: merge only reads it
        warnings.simplefilter("ignore", UserWarning)
        rest = torch.frombuffer(payload, dtype=torch.uint8, count=rest_bytes)
        exps = torch.frombuffer(_zstd_decompress(payload[_padded(rest_bytes) : payload_bytes], n), dtype=torch.uint8)
    return merge_exponents(exps, rest, dtype).reshape(shape)


def decode(shards: Sequence[Buffer], layout: KVLayout, device: torch.device | str | None = None) -> torch.Tensor:
    """All shards of one transfer back into the full [num_layers, 2, n, bs, Hkv, D] tensor."""
    parts = sorted((decode_shard(s, layout, device) for s in shards), key=lambda d: d.header.layer_start)
    if not parts:
        raise ValueError("no shards to decode")
    first = parts[0].header
    covered = [layer for d in parts for layer in d.layers]
    if covered != list(range(first.num_layers)) or {d.header.transfer_id for d in parts} != {first.transfer_id}:
        raise ValueError(f"shards do not make one transfer: layers {covered[:4]}..., {len(parts)} shards")
    return torch.cat([d.kv for d in parts])


def error_bound(x: torch.Tensor, compression: Compression | str) -> torch.Tensor:
    """The documented per-element bound on |x - decode(encode(x))| (see the module docstring)."""
    c = Compression.parse(compression)
    xf = x.float()
    if c.lossless:
        return torch.zeros_like(xf)
    if c is Compression.INT8:
        k, v = xf.unbind(1)  # [L, n, bs, H, D]
        k_scale = ceil_bf16(k.abs().amax(dim=2, keepdim=True) / 127.0).expand_as(k)
        v_scale = ceil_bf16(v.abs().amax(dim=-1, keepdim=True) / 127.0).expand_as(v)
        bound = torch.stack((k_scale, v_scale), dim=1) * (0.5 + 2.0**-15)
    else:
        nl, two, n = x.shape[:3]
        s = xf.abs().reshape(nl, two, n, -1).amax(dim=-1).reshape(nl, two, n, 1, 1, 1) / 448.0
        bound = 2.0**-4 * xf.abs() + 2.0**-10 * s
    # the result is rounded to x's dtype: half an ulp of |x̂| <= |x| + bound
    return bound + _HALF_ULP[x.dtype] * (xf.abs() + bound)
