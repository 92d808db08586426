"""The two storage tiers of a prefix-cache store: DRAM and local disk, each bounded in bytes.

Mental model: each tier is a dict of payloads (DRAM) or payload sizes (disk) plus a running byte
count, and nothing more: which block enters, which leaves and where it goes is the store's
decision (`value.py` ranks them); a tier only refuses to be overfilled. "Bytes" always means
*payload* bytes, in both tiers, so a block moving from one tier to the other moves exactly its
size; the disk tier's 36-byte file header is not counted.

Disk layout: one file per block, `<32 hex digits of the hash>.blk`, holding a fixed header
(magic, version, the key, the payload length, a crc32 of the payload, as the codec uses) followed by
the payload. A file is written under `<hex>.tmp` and renamed into place, so a reader never sees a
half-written `.blk`; a file that is torn, truncated, renamed or corrupted anyway fails the header
or checksum check and is deleted and reported as a miss. No fsync: the directory does not outlive
its store (see `DiskTier.__init__`), and a crash mid-write is caught by the checksum.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import IO

from actors.engine.block_hash import HASH_BYTES, BlockHash

logger = logging.getLogger(__name__)

BLOCK_SUFFIX = ".blk"
TMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
_MAGIC = b"FPCB"
_VERSION = 2  # 1 had a blake2b-128 checksum: 5x slower on every spill and every disk hit
_HEADER = struct.Struct("<4sB3x16sQI")  # magic, version, key, payload length, crc32
HEADER_BYTES = _HEADER.size


class CacheDirInUse(RuntimeError):
    """Another live store holds this disk directory (two stores were given the same id)."""


def _checksum(payload: bytes) -> int:
    return zlib.crc32(payload)


class DramTier:
    """Payloads in memory, bounded by `capacity_bytes`."""

    def __init__(self, capacity_bytes: int) -> None:
        assert capacity_bytes > 0
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: dict[BlockHash, bytes] = {}

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_hash: BlockHash) -> bytes:
        return self._blocks[block_hash]

    def insert(self, block_hash: BlockHash, payload: bytes) -> None:
        """Adds a new block; the caller made room first."""
        assert block_hash not in self._blocks and self.used_bytes + len(payload) <= self.capacity_bytes
        self._blocks[block_hash] = payload
        self.used_bytes += len(payload)

    def pop(self, block_hash: BlockHash) -> bytes | None:
        payload = self._blocks.pop(block_hash, None)
        if payload is not None:
            self.used_bytes -= len(payload)
        return payload

    def clear(self) -> None:
        self._blocks.clear()
        self.used_bytes = 0

    def check_integrity(self) -> None:
        assert self.used_bytes == sum(len(p) for p in self._blocks.values()), "DRAM byte count"
        assert 0 <= self.used_bytes <= self.capacity_bytes, "DRAM over its bound"
        assert all(isinstance(p, bytes) for p in self._blocks.values())


class DiskTier:
    """Payloads in files under `directory`, bounded by `capacity_bytes` of payload."""

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        assert capacity_bytes > 0
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.num_corrupt = 0
        self.num_write_errors = 0
        self._index: dict[BlockHash, int] = {}  # hash -> payload bytes
        directory.mkdir(parents=True, exist_ok=True)
        self._lock: IO[str] | None = self._take_lock()
        # Leftovers belong to a dead store with this id (the lock proves none is alive). Its
        # index died with it, so its files are unreachable: adopting them would need a scan and
        # re-verification of every file for blocks that are cheap to recompute. Delete them.
        removed = self._delete_block_files()
        if removed:
            logger.info("removed %d stale prefix-cache files from %s", removed, directory)

    def _take_lock(self) -> IO[str]:
        lock = open(self.directory / LOCK_NAME, "a+")  # noqa: SIM115 - held for the tier's life
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise CacheDirInUse(f"{self.directory} is used by another live prefix-cache store")
        return lock

    def _delete_block_files(self) -> int:
        removed = 0
        for path in self.directory.iterdir():
            if path.suffix in (BLOCK_SUFFIX, TMP_SUFFIX) and path.is_file():
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def path_of(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash:032x}{BLOCK_SUFFIX}"

    def insert(self, block_hash: BlockHash, payload: bytes) -> bool:
        """Writes a new block (the caller made room first); False when the write failed."""
        assert block_hash not in self._index and self.used_bytes + len(payload) <= self.capacity_bytes
        path = self.path_of(block_hash)
        tmp = path.with_suffix(TMP_SUFFIX)
        key = block_hash.to_bytes(HASH_BYTES, "little")
        header = _HEADER.pack(_MAGIC, _VERSION, key, len(payload), _checksum(payload))
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            # A full or failing disk loses this block, never the request that spilled it.
            self.num_write_errors += 1
            logger.warning("prefix-cache spill to %s failed: %s", path, e)
            tmp.unlink(missing_ok=True)
            return False
        self._index[block_hash] = len(payload)
        self.used_bytes += len(payload)
        return True

    def read(self, block_hash: BlockHash) -> bytes | None:
        """The verified payload (the block stays; the caller decides where it goes). A missing,
        torn or corrupt file is deleted, dropped from the index and returns None."""
        assert block_hash in self._index
        path = self.path_of(block_hash)
        try:
            data = path.read_bytes()
        except OSError as e:
            return self._drop_corrupt(block_hash, f"unreadable: {e}")
        if len(data) < HEADER_BYTES:
            return self._drop_corrupt(block_hash, f"torn: {len(data)} bytes")
        magic, version, key, length, checksum = _HEADER.unpack_from(data)
        payload = data[HEADER_BYTES:]
        if magic != _MAGIC or version != _VERSION:
            return self._drop_corrupt(block_hash, "bad magic or version")
        if key != block_hash.to_bytes(HASH_BYTES, "little") or length != self._index[block_hash]:
            return self._drop_corrupt(block_hash, "header does not match the index")
        if len(payload) != length or _checksum(payload) != checksum:
            return self._drop_corrupt(block_hash, "payload length or checksum mismatch")
        return payload

    def _drop_corrupt(self, block_hash: BlockHash, why: str) -> None:
        self.num_corrupt += 1
        logger.warning("prefix-cache file %s is %s; dropped", self.path_of(block_hash), why)
        self.pop(block_hash)
        return None

    def pop(self, block_hash: BlockHash) -> bool:
        size = self._index.pop(block_hash, None)
        if size is None:
            return False
        self.used_bytes -= size
        self.path_of(block_hash).unlink(missing_ok=True)
        return True

    def clear(self) -> None:
        self._delete_block_files()
        self._index.clear()
        self.used_bytes = 0

    def close(self) -> None:
        """Deletes every block file and releases the directory for a future store."""
        self.clear()
        if self._lock is not None:
            self._lock.close()  # closing the descriptor releases the flock
            self._lock = None

    def check_integrity(self) -> None:
        assert self.used_bytes == sum(self._index.values()), "disk byte count"
        assert 0 <= self.used_bytes <= self.capacity_bytes, "disk over its bound"
        on_disk = {p.name: p.stat().st_size for p in self.directory.iterdir() if p.is_file()}
        expected = {self.path_of(h).name: HEADER_BYTES + n for h, n in self._index.items()}
        blocks = {name: size for name, size in on_disk.items() if name.endswith(BLOCK_SUFFIX)}
        assert blocks == expected, "files on disk differ from the index"
        assert not any(name.endswith(TMP_SUFFIX) for name in on_disk), "leftover temp file"
