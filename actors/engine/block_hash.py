"""Chained block hashes: the one definition of a KV block's identity in the whole project.

A full block of `block_size` tokens is identified by
`hash(parent_hash, token_ids, extra_keys)`, so equal hashes mean equal *prefixes*, not just equal
blocks. `extra_keys` carries whatever else changes the KV (a tenant's cache salt, an adapter id).
The engine's block pool, the prefix-cache pool and the scheduler's router all call this module, so a
hash computed on one process matches the same prefix on any other: it is sha256-based, never
Python's per-process salted `hash()`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

BlockHash = NewType("BlockHash", int)  # 128-bit, fits the codec's fixed 16-byte field

ROOT_HASH = BlockHash(0)  # the parent of a sequence's first block
HASH_BYTES = 16


def _encode_extra(extra_keys: tuple[object, ...]) -> bytes:
    # Only str/int/bytes are allowed so the encoding is canonical across processes.
    parts = []
    for key in extra_keys:
        if isinstance(key, bytes):
            parts.append(b"b" + struct.pack("<I", len(key)) + key)
        elif isinstance(key, str):
            raw = key.encode()
            parts.append(b"s" + struct.pack("<I", len(raw)) + raw)
        elif isinstance(key, int):
            parts.append(b"i" + key.to_bytes(16, "little", signed=True))
        else:
            raise TypeError(f"extra key {key!r} must be str, int or bytes")
    return b"".join(parts)


def hash_block(
    parent_hash: BlockHash, token_ids: Sequence[int], extra_keys: tuple[object, ...] = ()
) -> BlockHash:
    h = hashlib.sha256()
    h.update(parent_hash.to_bytes(HASH_BYTES, "little"))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    h.update(_encode_extra(extra_keys))
    return BlockHash(int.from_bytes(h.digest()[:HASH_BYTES], "little"))


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[object, ...] = (),
    parent_hash: BlockHash = ROOT_HASH,
) -> list[BlockHash]:
    """Hashes of every *full* block of `token_ids`; a partial last block has no hash."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent_hash)
    return hashes
