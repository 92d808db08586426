"""The binary shard header: a frozen 16-byte prefix, then a versioned body, then the block hashes.

Layout (little endian; the payload starts at `header_len`, a multiple of 64 so that any dtype can be
viewed in place):

    prefix (the same in every version)   magic "FKVS" | version u16 | reserved u16 | header_len u32 | crc32 u32
    body, version 2                      layout_id u64 | transfer_id u64 | raw_bytes u64 | payload_bytes u64 |
                                         num_blocks u32 | block_size u32 | num_layers u16 | layer_start u16 |
                                         layer_end u16 | shard_index u16 | num_shards u16 | num_kv_heads u16 |
                                         head_dim u16 | dtype u8 | compression u8
    hashes                               num_blocks x 16 bytes (a block without a hash carries 0)
    padding to header_len, then payload_bytes of payload

The crc32 covers every byte of the shard except its own four, so a flipped bit anywhere (prefix,
body, hashes, payload) is caught. Checks run in the order that gives the right error: magic and
length (else `CorruptShard`), checksum (`CorruptShard`), version (`IncompatiblePeer`); the layout
check belongs to the codec. Freezing the prefix is what lets a peer of any version be refused with
a clear message instead of a misparse.

The version covers the payload too. Version 2 changed only the `int8` payload (codec.py: per-channel
K scales, per-token V scales, both bf16); its header is version 1's, so a version-1 peer is refused
rather than misread.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transfer.transport import CorruptShard, IncompatiblePeer, is_tensor

MAGIC = b"FKVS"
VERSION = 2
HASH_BYTES = 16  # the engine's BlockHash width (actors/engine/block_hash.py; a test keeps them equal)
ALIGN = 64

_PREFIX = struct.Struct("<4sHHII")
_BODY = struct.Struct("<QQQQIIHHHHHHHBB")
_CRC_AT = 12  # offset of the crc32 field inside the prefix
PREFIX_BYTES = _PREFIX.size


@dataclass(frozen=True)
class ShardHeader:
    layout_id: int
    transfer_id: int
    raw_bytes: int  # this shard's KV before compression
    payload_bytes: int
    num_blocks: int
    block_size: int
    num_layers: int  # of the whole model, so a receiver can tell when it has every layer
    layer_start: int
    layer_end: int
    shard_index: int
    num_shards: int
    num_kv_heads: int
    head_dim: int
    dtype: int  # codec's dtype code
    compression: int  # codec's compression code
    block_hashes: tuple[int, ...]

    @property
    def header_len(self) -> int:
        return header_len(self.num_blocks)

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


def header_len(num_blocks: int) -> int:
    n = _PREFIX.size + _BODY.size + HASH_BYTES * num_blocks
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack_into(out: memoryview, h: ShardHeader) -> None:
    """Writes the header (crc left 0) into the start of `out`; `seal` fills the crc afterwards."""
    n = h.header_len
    assert len(h.block_hashes) == h.num_blocks and len(out) >= n
    _PREFIX.pack_into(out, 0, MAGIC, VERSION, 0, n, 0)
    _BODY.pack_into(
        out, _PREFIX.size, h.layout_id, h.transfer_id, h.raw_bytes, h.payload_bytes, h.num_blocks,
        h.block_size, h.num_layers, h.layer_start, h.layer_end, h.shard_index, h.num_shards,
        h.num_kv_heads, h.head_dim, h.dtype, h.compression,
    )
    at = _PREFIX.size + _BODY.size
    for block_hash in h.block_hashes:
        out[at : at + HASH_BYTES] = int(block_hash).to_bytes(HASH_BYTES, "little")
        at += HASH_BYTES
    out[at:n] = bytes(n - at)


def _crc(shard: memoryview) -> int:
    return zlib.crc32(shard[_CRC_AT + 4 :], zlib.crc32(shard[:_CRC_AT]))


def seal(shard: memoryview) -> None:
    """Stores the checksum of a fully written shard."""
    struct.pack_into("<I", shard, _CRC_AT, _crc(shard))


def unpack(shard: memoryview) -> ShardHeader:
    """Validates a whole shard (header and payload) and returns its header."""
    return unpack_head(shard, len(shard), lambda: _crc(shard))


def crc_split(head: memoryview, payload: memoryview) -> int:
    """The checksum `seal` stores, of a shard held as its header (exactly `header_len` bytes) and its
    payload apart: a device shard's payload is copied to the host for this, and only for this."""
    return zlib.crc32(payload, _crc(head))


def seal_split(head: memoryview, payload: memoryview) -> None:
    """`seal` for a shard whose header and payload are held apart (see `crc_split`)."""
    struct.pack_into("<I", head, _CRC_AT, crc_split(head, payload))


def header_len_of(prefix: memoryview) -> int:
    """The header length a shard's first `PREFIX_BYTES` declare (unchecked: `unpack_head` checks)."""
    if len(prefix) < _PREFIX.size:
        raise CorruptShard(f"{len(prefix)} bytes is too short for a KV shard")
    return int(_PREFIX.unpack_from(prefix, 0)[3])


def unpack_head(head: memoryview, shard_len: int, crc: Callable[[], int] | None) -> ShardHeader:
    """Validates the header of a shard of `shard_len` bytes from its first bytes `head` (at least
    its header length, when that fits the shard). `crc()` computes the checksum of the whole shard;
    None skips it (the caller vouches for the payload, e.g. a device shard it chose not to copy)."""
    if len(head) < _PREFIX.size:
        raise CorruptShard(f"{len(head)} bytes is too short for a KV shard")
    magic, version, _, hlen, stored = _PREFIX.unpack_from(head, 0)
    if magic != MAGIC:
        raise CorruptShard(f"bad magic {bytes(magic)!r}: not a ferry KV shard")
    if hlen < _PREFIX.size or hlen > shard_len or hlen > len(head):
        raise CorruptShard(f"header length {hlen} does not fit a shard of {shard_len} bytes")
    if crc is not None and crc() != stored:
        raise CorruptShard("checksum mismatch: the shard was damaged in flight")
    if version != VERSION:
        raise IncompatiblePeer(f"peer sent KV shard format version {version}; this side speaks {VERSION}")
    if hlen < _PREFIX.size + _BODY.size:
        raise CorruptShard(f"header length {hlen} is too short for a version {VERSION} header")
    f = _BODY.unpack_from(head, _PREFIX.size)
    num_blocks = f[4]
    if header_len(num_blocks) != hlen:
        raise CorruptShard(f"header length {hlen} disagrees with {num_blocks} blocks")
    at = _PREFIX.size + _BODY.size
    hashes = tuple(
        int.from_bytes(head[at + i * HASH_BYTES : at + (i + 1) * HASH_BYTES], "little") for i in range(num_blocks)
    )
    h = ShardHeader(*f, block_hashes=hashes)
    if hlen + h.payload_bytes != shard_len:
        raise CorruptShard(f"shard is {shard_len} bytes; its header promises {hlen + h.payload_bytes}")
    return h


def peek_raw_bytes(shard: Any) -> int | None:
    """The uncompressed size a codec shard (host bytes or a uint8 tensor) declares, without validating
    it (for stats only). A device tensor has its first 64 bytes copied to the host."""
    if is_tensor(shard):
        shard = memoryview(shard[: _PREFIX.size + _BODY.size].cpu().numpy())
    if len(shard) < _PREFIX.size + _BODY.size or bytes(shard[:4]) != MAGIC:
        return None
    if struct.unpack_from("<H", shard, 4)[0] != VERSION:
        return None
    return int(struct.unpack_from("<Q", shard, _PREFIX.size + 16)[0])
