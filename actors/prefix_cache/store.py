"""One prefix-cache store: KV blocks keyed by chained block hash, in DRAM spilling to local disk.

Mental model: two exclusive LRU tiers. A block lives in exactly one of them. `put` places new
blocks in DRAM as most recently used; DRAM evicts its least recently used blocks to disk (in
eviction order, so the disk LRU continues the DRAM LRU), and disk evicts by deleting files. A
`get` that hits disk promotes the block back to DRAM (which may spill others). Payloads are opaque
bytes (one KV block across all layers, made by the transfer codec); the store never reads them.

Queries do not disturb the LRU: `match_prefix` and `contains` only look at the indexes, so the
router and the pool may probe freely; only `put` (re-touching an existing key) and `get` count as
use. A consequence: a disk block that `match_prefix` counted may still turn out corrupt at `get`
time, so callers use the number of payloads `get_prefix` returned, not the earlier match.

Tenant isolation is not done here: tenants get different hashes (a cache salt in `extra_keys`).

The store is not thread-safe; as a Ray actor it runs one method at a time. Everything its methods
take and return is ints, bytes, lists and dicts, so the same object works behind a Ray handle.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from actors.engine.block_hash import BlockHash
from actors.engine.fetch import ferry_home
from actors.prefix_cache.stats import PrefixCacheStats
from actors.prefix_cache.tiers import DiskTier, DramTier

logger = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
_STORE_ID = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class PrefixCacheConfig:
    dram_bytes: int = 256 * MiB
    disk_bytes: int = 1 * GiB
    disk_dir: str | None = None  # root of every store's folder; None -> $FERRY_HOME/prefix_cache
    enable_disk: bool = True

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise ValueError(f"dram_bytes must be positive, got {self.dram_bytes}")
        if self.enable_disk and self.disk_bytes <= 0:
            raise ValueError(f"disk_bytes must be positive when the disk tier is on, got {self.disk_bytes}")

    def store_dir(self, store_id: str) -> Path:
        root = Path(self.disk_dir).expanduser() if self.disk_dir else ferry_home() / "prefix_cache"
        return root / store_id


def check_block_hash(block_hash: object) -> BlockHash:
    valid = isinstance(block_hash, int) and not isinstance(block_hash, bool) and 0 <= block_hash < 1 << 128
    if not valid:
        raise ValueError(f"a block hash is an int in [0, 2**128), got {block_hash!r}")
    return BlockHash(block_hash)


class PrefixCacheStore:
    def __init__(self, cfg: PrefixCacheConfig | None = None, store_id: str = "default") -> None:
        if not _STORE_ID.fullmatch(store_id) or store_id in (".", ".."):
            raise ValueError(f"store id {store_id!r} must be letters, digits, '_', '.' or '-'")
        self.cfg = cfg or PrefixCacheConfig()
        self.store_id = store_id
        self._dram = DramTier(self.cfg.dram_bytes)
        # On start the store's own folder is emptied (see DiskTier): a lock file makes sure no
        # live store shares it, so only a dead store's leftovers are deleted.
        self._disk: DiskTier | None = None
        if self.cfg.enable_disk:
            self._disk = DiskTier(self.cfg.store_dir(store_id), self.cfg.disk_bytes)
        self._num_puts = 0
        self._num_put_refused = 0
        self._num_hits_dram = 0
        self._num_hits_disk = 0
        self._num_misses = 0

    # --- commands -------------------------------------------------------------------------

    def put(self, blocks: Iterable[tuple[BlockHash, bytes]]) -> int:
        """Stores new blocks in DRAM; returns how many were new. A key already present in either
        tier is only marked recently used (same hash = same prefix = same KV). A block larger than
        the DRAM bound is refused: every stored block must be able to come back into DRAM."""
        stored = 0
        for block_hash, payload in blocks:
            block_hash = check_block_hash(block_hash)
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                raise TypeError(f"a payload is bytes, got {type(payload).__name__}")
            if block_hash in self._dram:
                self._dram.touch(block_hash)
            elif self._disk is not None and block_hash in self._disk:
                self._disk.touch(block_hash)
            elif len(payload) > self.cfg.dram_bytes:
                self._num_put_refused += 1
                logger.debug("refused a %d-byte block: DRAM holds %d", len(payload), self.cfg.dram_bytes)
            else:
                self._insert_dram(block_hash, bytes(payload))  # bytes(): an immutable copy we own
                stored += 1
        self._num_puts += stored
        return stored

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """Payload per hash (None for a miss); each hit becomes most recently used in DRAM."""
        return [self._lookup(check_block_hash(h)) for h in hashes]

    def get_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        """Payloads of the leading hits, stopping at the first miss (nothing after it is touched)."""
        out: list[bytes] = []
        for h in hashes:
            payload = self._lookup(check_block_hash(h))
            if payload is None:
                break
            out.append(payload)
        return out

    def remove(self, hashes: Iterable[BlockHash]) -> int:
        removed = 0
        for h in hashes:
            h = check_block_hash(h)
            if self._dram.pop(h) is not None or (self._disk is not None and self._disk.pop(h)):
                removed += 1
        return removed

    def clear(self) -> None:
        self._dram.clear()
        if self._disk is not None:
            self._disk.clear()

    def close(self) -> None:
        """Drops every block and frees the disk folder for a later store with this id."""
        self._dram.clear()
        if self._disk is not None:
            self._disk.close()

    def _lookup(self, h: BlockHash) -> bytes | None:
        payload = self._dram.get(h)
        if payload is not None:
            self._num_hits_dram += 1
            return payload
        if self._disk is not None and h in self._disk:
            payload = self._disk.read(h)
            if payload is not None:
                self._num_hits_disk += 1
                self._disk.pop(h)  # free its disk bytes before DRAM spills into the disk tier
                self._insert_dram(h, payload)
                return payload
        self._num_misses += 1
        return None

    def _insert_dram(self, h: BlockHash, payload: bytes) -> None:
        for old_hash, old_payload in self._dram.insert(h, payload):
            if self._disk is not None:
                self._disk.insert(old_hash, old_payload)

    # --- queries (never change the LRU order) -----------------------------------------------

    def match_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading hashes present in any tier."""
        n = 0
        for h in hashes:
            if not self.contains(h):
                break
            n += 1
        return n

    def contains(self, block_hash: BlockHash) -> bool:
        h = check_block_hash(block_hash)
        return h in self._dram or (self._disk is not None and h in self._disk)

    def dram_lru_order(self) -> list[BlockHash]:
        return self._dram.lru_order()

    def disk_lru_order(self) -> list[BlockHash]:
        return self._disk.lru_order() if self._disk is not None else []

    def disk_path(self, block_hash: BlockHash) -> Path | None:
        """Where a disk-tier block's file lives (None without a disk tier)."""
        return self._disk.path_of(check_block_hash(block_hash)) if self._disk is not None else None

    def stats(self) -> PrefixCacheStats:
        dram, disk = self._dram, self._disk
        return PrefixCacheStats(
            num_puts=self._num_puts,
            num_put_refused=self._num_put_refused,
            num_hits_dram=self._num_hits_dram,
            num_hits_disk=self._num_hits_disk,
            num_misses=self._num_misses,
            num_dram_evictions=dram.num_evictions,
            # `is None`, not truthiness: an empty tier has len() 0 but still counts.
            num_disk_evictions=0 if disk is None else disk.num_evictions,
            num_corrupt=0 if disk is None else disk.num_corrupt,
            num_disk_write_errors=0 if disk is None else disk.num_write_errors,
            num_dram_blocks=len(dram),
            num_disk_blocks=0 if disk is None else len(disk),
            dram_bytes=dram.used_bytes,
            disk_bytes=0 if disk is None else disk.used_bytes,
        )

    def stats_dict(self) -> dict[str, int]:
        """`stats()` as plain ints, for callers in other processes."""
        return self.stats().to_dict()

    def check_integrity(self) -> None:
        self._dram.check_integrity()
        if self._disk is not None:
            self._disk.check_integrity()
            assert not set(self._dram.lru_order()) & set(self._disk.lru_order()), "tiers overlap"
