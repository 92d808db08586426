"""The shard format: exact round trips, documented error bounds, and every refusal the header promises."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from kernels.quant import dequantize_int8_ref, quantize_int8_ref
from transfer import header
from transfer.codec import Compression, KVLayout, decode, decode_shard, encode, error_bound, layer_groups
from transfer.transport import CorruptShard, IncompatiblePeer

LAYOUT = KVLayout("tiny", num_layers=5, num_kv_heads=3, head_dim=16, block_size=4)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_kv(num_blocks: int = 3, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim,
                     generator=g) * 3
    kv[0, 1, 0] = 0.0  # an all-zero block and rows: scale 0 must not divide by zero
    kv[2, 0, 1, 2, 1] = 1e-3  # a row with a tiny range
    return kv.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_shards", [1, 2, 5])
def test_none_is_bit_exact_and_shards_cover_layers_in_order(dtype: torch.dtype, num_shards: int) -> None:
    kv = make_kv(dtype=dtype)
    shards = encode(kv, LAYOUT, num_shards=num_shards, block_hashes=[11, 12, 2**128 - 1], transfer_id=42)
    decoded = [decode_shard(s, LAYOUT) for s in shards]
    assert [d.layers for d in decoded] == layer_groups(5, num_shards)
    for i, d in enumerate(decoded):
        assert d.header.shard_index == i and d.header.num_shards == num_shards
        assert d.header.block_hashes == (11, 12, 2**128 - 1) and d.header.transfer_id == 42
        assert d.kv.dtype == dtype
        assert torch.equal(d.kv.view(torch.uint8), kv[d.layers.start : d.layers.stop].view(torch.uint8))
    assert torch.equal(decode(shards, LAYOUT).view(torch.uint8), kv.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compression", ["int8", "fp8"])
def test_quantized_round_trip_within_documented_bound(dtype: torch.dtype, compression: str) -> None:
    kv = make_kv(num_blocks=4, dtype=dtype, seed=1)
    out = decode(encode(kv, LAYOUT, compression=compression, num_shards=2), LAYOUT)
    assert out.dtype == dtype and out.shape == kv.shape
    err = (out.float() - kv.float()).abs()
    bound = error_bound(kv, compression)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert not torch.equal(out, kv)  # it did quantize: a bound test that cannot fail is no test
    assert bool((out[0, 1, 0] == 0).all())  # zero block stays exactly zero


def test_int8_scales_k_per_channel_so_outlier_channels_cost_the_others_nothing() -> None:
    """K with a few large channels (as real K has): a per-(token, head) scale is set by the outliers,
    the codec's per-channel scale is not, so its K error on the other channels is far smaller."""
    kv = make_kv(num_blocks=4, seed=3)
    kv[:, 0, ..., :2] *= 30.0  # two outlier channels in every head's K
    out = decode(encode(kv, LAYOUT, compression="int8"), LAYOUT)
    q, s = quantize_int8_ref(kv)
    per_token = dequantize_int8_ref(q, s)
    k_err, k_err_per_token = ((x[:, 0, ..., 2:] - kv[:, 0, ..., 2:]).abs().mean() for x in (out, per_token))
    assert k_err < k_err_per_token / 10


@pytest.mark.parametrize("compression", ["int8", "fp8"])
def test_a_block_decodes_the_same_alone(compression: str) -> None:
    """Scales never span blocks, so shipping one block (the prefix-cache pool does) gives the same
    values as shipping it among others."""
    kv = make_kv(num_blocks=3, dtype=torch.bfloat16, seed=4)
    whole = decode(encode(kv, LAYOUT, compression=compression), LAYOUT)
    for j in range(3):
        alone = decode(encode(kv[:, :, j : j + 1], LAYOUT, compression=compression), LAYOUT)
        assert torch.equal(alone, whole[:, :, j : j + 1])


def test_wire_sizes_int8_about_half_of_bf16_fp8_half() -> None:
    kv = make_kv(num_blocks=8, dtype=torch.bfloat16)
    raw = sum(len(s) for s in encode(kv, LAYOUT))
    int8 = sum(len(s) for s in encode(kv, LAYOUT, compression="int8"))
    fp8 = sum(len(s) for s in encode(kv, LAYOUT, compression="fp8"))
    payload = kv.numel() * 2
    # int8: a byte per value, a 2-byte K scale per (layer, block, head, channel) and a 2-byte V scale
    # per (layer, block, token, head); at this tiny block (4 x 16) that is 0.66 of bf16, 0.54 at 16 x 64
    L, H, D, bs = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim, LAYOUT.block_size
    assert int8 - (raw - payload) == kv.numel() + L * 8 * H * D * 2 + L * 8 * bs * H * 2
    assert fp8 - (raw - payload) == kv.numel() + LAYOUT.num_layers * 2 * 8 * 4
    assert header.peek_raw_bytes(memoryview(encode(kv, LAYOUT, compression="int8")[0])) == payload


def test_header_layout_is_fixed() -> None:
    # prefix 16 + body 56 + 16 per block hash, padded to 64: 3 blocks -> 120 -> 128, 4 -> 136 -> 192
    assert (header.header_len(0), header.header_len(3), header.header_len(4)) == (128, 128, 192)
    shard = encode(make_kv(), LAYOUT)[0]
    assert bytes(shard[:4]) == b"FKVS"
    assert struct.unpack_from("<HHI", shard, 4) == (header.VERSION, 0, 128)


def test_header_hash_field_is_a_block_hash_wide() -> None:
    # Two definitions of one width: transfer/ may not import actors/, and block_hash.py stays
    # torch-free (importing transfer loads torch), so this test is what keeps them one number.
    from actors.engine.block_hash import HASH_BYTES

    assert header.HASH_BYTES == HASH_BYTES


def flip(shard: bytearray, at: int) -> bytearray:
    out = bytearray(shard)
    out[at] ^= 0x40
    return out


@pytest.mark.parametrize("where", ["version", "body", "hashes", "payload_start", "payload_end", "crc"])
def test_flipped_byte_anywhere_is_corrupt_shard(where: str) -> None:
    shard = encode(make_kv(), LAYOUT, compression="int8", block_hashes=[1, 2, 3])[0]
    at = {"version": 4, "body": 30, "hashes": 100, "payload_start": 128, "payload_end": len(shard) - 1,
          "crc": 13}[where]
    with pytest.raises(CorruptShard):
        decode_shard(flip(shard, at), LAYOUT)


def test_truncated_and_foreign_bytes_are_corrupt_shard() -> None:
    shard = encode(make_kv(), LAYOUT)[0]
    for bad in (shard[:-1], shard[:10], b"", b"not a shard at all, just bytes" * 4, shard + b"\0"):
        with pytest.raises(CorruptShard):
            decode_shard(bytes(bad), LAYOUT)


def with_version(shard: bytearray, version: int) -> bytearray:
    """The shard as a peer of another format version would send it (a valid checksum)."""
    out = bytearray(shard)
    struct.pack_into("<H", out, 4, version)
    header.seal(memoryview(out))
    return out


def test_other_version_is_incompatible_peer() -> None:
    shard = encode(make_kv(), LAYOUT)[0]
    for version in (0, header.VERSION - 1, header.VERSION + 1, 65535):
        with pytest.raises(IncompatiblePeer, match=f"version {version}"):
            decode_shard(with_version(shard, version), LAYOUT)
    decode_shard(with_version(shard, header.VERSION), LAYOUT)  # resealing alone changes nothing


@pytest.mark.parametrize("field", ["model", "num_layers", "num_kv_heads", "head_dim", "block_size"])
def test_other_layout_is_incompatible_peer(field: str) -> None:
    shard = encode(make_kv(), LAYOUT)[0]
    values = vars(LAYOUT) | {field: "other" if field == "model" else getattr(LAYOUT, field) * 2}
    with pytest.raises(IncompatiblePeer, match="layout"):
        decode_shard(shard, KVLayout(**values))


def test_unknown_compression_code_is_incompatible_peer() -> None:
    shard = bytearray(encode(make_kv(), LAYOUT)[0])
    shard[16 + 55] = 9  # the compression byte, last of the body
    header.seal(memoryview(shard))
    with pytest.raises(IncompatiblePeer, match="compression code 9"):
        decode_shard(shard, LAYOUT)


def test_crc_covers_everything_but_itself() -> None:
    shard = encode(make_kv(), LAYOUT)[0]
    (crc,) = struct.unpack_from("<I", shard, 12)
    assert crc == zlib.crc32(bytes(shard[16:]), zlib.crc32(bytes(shard[:12])))


def test_decode_refuses_mixed_or_missing_shards() -> None:
    a = encode(make_kv(seed=1), LAYOUT, num_shards=2, transfer_id=1)
    b = encode(make_kv(seed=2), LAYOUT, num_shards=2, transfer_id=2)
    with pytest.raises(ValueError):
        decode([a[0]], LAYOUT)
    with pytest.raises(ValueError):
        decode([a[0], b[1]], LAYOUT)


def test_bad_input_is_refused_before_encoding() -> None:
    with pytest.raises(ValueError, match="does not match"):
        encode(torch.zeros(4, 2, 1, 4, 3, 16), LAYOUT)
    with pytest.raises(ValueError, match="num_shards"):
        encode(make_kv(), LAYOUT, num_shards=6)
    with pytest.raises(ValueError, match="block hashes"):
        encode(make_kv(), LAYOUT, block_hashes=[1])
    with pytest.raises(ValueError, match="compression"):
        Compression.parse("brotli")


def test_receiver_writes_each_shard_as_it_decodes() -> None:
    """The pipelining the layer split is for: shard i lands in the pool on its own."""
    kv = make_kv(num_blocks=2)
    pool = torch.zeros(LAYOUT.num_layers, 2, 6, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    targets = [5, 1]
    for shard in encode(kv, LAYOUT, num_shards=3):
        d = decode_shard(shard, LAYOUT)
        pool[d.layers.start : d.layers.stop][:, :, targets] = d.kv
    assert torch.equal(pool[:, :, targets], kv)
    assert pool[:, :, [0, 2, 3, 4]].abs().sum() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("compression", ["none", "int8", "fp8"])
def test_cuda_kv_quantizes_on_device_and_decodes_to_device(compression: str) -> None:
    kv = make_kv(num_blocks=4, dtype=torch.bfloat16).cuda()
    out = decode(encode(kv, LAYOUT, compression=compression, num_shards=2), LAYOUT, device="cuda")
    assert out.device.type == "cuda" and out.dtype == kv.dtype
    assert bool(((out.float() - kv.float()).abs() <= error_bound(kv, compression)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_shards", [1, 3])
def test_zstd_is_bit_exact_and_shrinks_kv(dtype: torch.dtype, num_shards: int) -> None:
    kv = make_kv(num_blocks=8, dtype=dtype)
    kv[1, 0, 2, 1] = float("nan")  # bits, not values: a NaN and -0 come back as they went
    kv[3, 1, 5] = -0.0
    shards = encode(kv, LAYOUT, compression="zstd", num_shards=num_shards, block_hashes=range(1, 9), transfer_id=7)
    out = decode(shards, LAYOUT)
    assert out.dtype == dtype and torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    assert all(decode_shard(s, LAYOUT).header.compression == int(Compression.ZSTD) for s in shards)
    raw = kv.numel() * kv.element_size()
    # the exponent bytes of normal values shrink: in float32 ~1/4 of the bytes, in 2-byte floats 1/2
    # (float16's byte after the sign holds 3 mantissa bits too)
    assert sum(map(len, shards)) < raw * {torch.float32: 0.95, torch.bfloat16: 0.85, torch.float16: 0.9}[dtype]
    assert Compression.ZSTD.lossless and Compression.NONE.lossless and not Compression.INT8.lossless
    assert torch.equal(error_bound(kv, "zstd"), torch.zeros_like(kv, dtype=torch.float32))


def test_a_damaged_zstd_shard_is_refused() -> None:
    kv = make_kv(num_blocks=4, dtype=torch.bfloat16)
    (shard,) = encode(kv, LAYOUT, compression="zstd")
    flipped = bytearray(shard)
    flipped[-2] ^= 0x10  # inside the zstd frame
    with pytest.raises(CorruptShard, match="checksum"):
        decode_shard(flipped, LAYOUT)
    # a frame that passes the checksum but is not zstd (a buggy peer): refused, never misread
    with pytest.raises(CorruptShard, match="zstd"):
        decode_shard(flipped, LAYOUT, verify=False)


def test_zstd_is_a_host_codec() -> None:
    with pytest.raises(ValueError, match="host codec"):
        encode(make_kv(), LAYOUT, compression="zstd", device="cpu")
