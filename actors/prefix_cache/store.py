"""One prefix-cache store: KV blocks keyed by chained block hash, in DRAM spilling to local disk.

Mental model: two exclusive tiers; a block lives in exactly one of them, ranked by its value key
(`value.py`: decayed use count, recency, depth in its chain, shadow or not; plain recency in
"lru" mode). Admission: a new block enters DRAM if it fits or is worth more than what it would
displace, else it goes to disk on the same terms, else it is refused. Blocks displaced from DRAM
spill to disk (admitted there the same way), and disk deletes what it displaces. A lookup that
hits disk promotes the block to DRAM when it is now worth it. `prefetch` promotes the leading
disk blocks of a chain a queued request will read, so its lookup finds them in DRAM; a prefetch
counts as the use the request will make, so the read that follows adds none.

Tenants: every put says whose blocks they are (tenants also get different hashes: a cache salt
in `extra_keys`). With `tenant_shares` on, each tier's bytes are shared as `TenantShares` says:
room is taken first from the tenants furthest above their guarantee, a tenant at its maximum in
a tier only displaces its own blocks (or is refused there), and no tenant's guaranteed part is
taken by another. Off (the default), value alone decides.

Queries do not count as use: `match_prefix` and `contains` only look at the indexes, so the
router and the pool may probe freely; only `put` (of a present key), `get` and `prefetch` do. A
disk block that `match_prefix` counted may still turn out corrupt at `get` time, so callers use
the number of payloads `get_prefix` returned, not the earlier match.

The store is not thread-safe; as a Ray actor it runs one method at a time. Everything its methods
take and return is str, ints, bytes, lists and dicts, so the same object works behind a Ray handle.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import fields
from pathlib import Path

from actors.engine.block_hash import BlockHash
from actors.holdings import HoldingsLog
from actors.prefix_cache.config import DEFAULT_TENANT, PrefixCacheConfig, check_block_hash
from actors.prefix_cache.stats import PrefixCacheStats
from actors.prefix_cache.tiers import DiskTier, DramTier
from actors.prefix_cache.value import BlockMeta, EvictionReason, Tier, TierIndex, ValueClock, block_weight

logger = logging.getLogger(__name__)

_STORE_ID = re.compile(r"[A-Za-z0-9_.-]+")
# Stats the tiers keep themselves, or that describe the store now; the rest the store counts.
_FROM_TIERS = {"num_corrupt", "num_disk_write_errors", "num_dram_blocks", "num_disk_blocks", "dram_bytes", "disk_bytes"}
_COUNTERS = tuple(f.name for f in fields(PrefixCacheStats) if f.name not in _FROM_TIERS)


class PrefixCacheStore:
    def __init__(self, cfg: PrefixCacheConfig | None = None, store_id: str = "default") -> None:
        if not _STORE_ID.fullmatch(store_id) or store_id in (".", ".."):
            raise ValueError(f"store id {store_id!r} must be letters, digits, '_', '.' or '-'")
        self.cfg = cfg = cfg or PrefixCacheConfig()
        self.store_id = store_id
        self._shares = cfg.tenant_shares
        self._clock = ValueClock(cfg.eviction, cfg.half_life_bytes or cfg.dram_bytes)
        self._metas: dict[BlockHash, BlockMeta] = {}  # every block, whichever tier holds it
        self._dram = DramTier(cfg.dram_bytes)
        self._index: dict[Tier, TierIndex] = {"dram": TierIndex("dram", cfg.dram_bytes, self._metas)}
        # On start the store's own folder is emptied (see DiskTier): a lock file makes sure no
        # live store shares it, so only a dead store's leftovers are deleted.
        self._disk: DiskTier | None = None
        if cfg.enable_disk:
            self._disk = DiskTier(cfg.store_dir(store_id), cfg.disk_bytes)
            self._index["disk"] = TierIndex("disk", cfg.disk_bytes, self._metas)
        self._n: Counter[str] = Counter()  # PrefixCacheStats counters by field name
        self._holdings = HoldingsLog()  # what `holdings` last reported, numbered

    # --- commands -------------------------------------------------------------------------

    def put(self, blocks: Iterable[tuple[BlockHash, bytes]], tenant: str = DEFAULT_TENANT,
            depths: Sequence[int] | None = None, shadow: bool = False) -> int:
        """Stores new blocks of `tenant` (`depths`: each block's position in its chain, default
        0, 1, ...; `shadow`: a request's private KV shadows); returns how many were stored. A key
        already present only counts as a use (same hash = same prefix = same KV). A block larger
        than the DRAM bound is refused: every stored block must be able to come back into DRAM."""
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"a tenant is a non-empty string, got {tenant!r}")
        blocks = list(blocks)
        depths = range(len(blocks)) if depths is None else depths
        if len(depths) != len(blocks) or any(d < 0 for d in depths):
            raise ValueError(f"need one depth >= 0 per block: {len(blocks)} blocks, depths {list(depths)[:8]}...")
        checked = []
        for (block_hash, payload), depth in zip(blocks, depths):
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                raise TypeError(f"a payload is bytes, got {type(payload).__name__}")
            checked.append((check_block_hash(block_hash), payload, int(depth)))
        stored = moved = 0
        for h, payload, depth in checked:
            meta = self._metas.get(h)
            if meta is not None:
                self._use(h, meta)
                moved += meta.size
                continue
            if len(payload) > self.cfg.dram_bytes:
                self._n["num_put_refused"] += 1
                logger.debug("refused a %d-byte block: DRAM holds %d", len(payload), self.cfg.dram_bytes)
                continue
            weight = block_weight(depth, shadow, self.cfg.depth_scale_blocks, self.cfg.shadow_weight)
            meta = BlockMeta(tenant, len(payload), weight, 0.0, self._clock.now, "dram", shadow=shadow)
            self._clock.use(meta, 1.0)
            tier = self._place_new(h, meta, bytes(payload))  # bytes(): an immutable copy we own
            if tier is None:
                self._n["num_put_refused"] += 1
                continue
            self._n[f"bytes_put_{tier}"] += meta.size
            stored += 1
            moved += meta.size
        self._n["num_puts"] += stored
        self._clock.advance(moved)
        return stored

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """Payload per hash (None for a miss); each hit counts as a use."""
        out = [self._lookup(check_block_hash(h)) for h in hashes]
        self._clock.advance(sum(len(p) for p in out if p is not None))
        return out

    def get_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        """Payloads of the leading hits, stopping at the first miss (nothing after it is touched)."""
        out: list[bytes] = []
        for h in hashes:
            payload = self._lookup(check_block_hash(h))
            if payload is None:
                break
            out.append(payload)
        self._clock.advance(sum(len(p) for p in out))
        return out

    def prefetch(self, hashes: Sequence[BlockHash]) -> int:
        """Promotes the leading run of `hashes` that is on disk to DRAM, for a request that will
        read it soon; stops at the first block missing, corrupt or that DRAM would not admit
        (it stays on disk). Returns how many moved up."""
        promoted = moved = 0
        for h in map(check_block_hash, hashes):
            meta = self._metas.get(h)
            if meta is None:
                break
            if not meta.read_counted:  # the queued request's read, counted now: its chain's
                self._use(h, meta)  # blocks in DRAM are not displaced by the ones moving up
                meta.read_counted = True
            if meta.tier == "dram":
                continue
            assert self._disk is not None
            payload = self._disk.read(h)
            if payload is None:
                self._forget_corrupt(h, meta)
                break
            if not self._promote(h, meta, payload):
                break  # the rest of the chain is worth less still
            meta.prefetched = True
            self._n["num_prefetched"] += 1
            promoted += 1
            moved += meta.size
        self._clock.advance(moved)
        return promoted

    def remove(self, hashes: Iterable[BlockHash]) -> int:
        removed = 0
        for h in hashes:
            h = check_block_hash(h)
            meta = self._metas.get(h)
            if meta is not None:
                self._take_out(h, meta)
                del self._metas[h]
                removed += 1
        return removed

    def clear(self) -> None:
        self._reset()
        if self._disk is not None:
            self._disk.clear()

    def close(self) -> None:
        """Drops every block and frees the disk folder for a later store with this id."""
        self._reset()
        if self._disk is not None:
            self._disk.close()

    def _reset(self) -> None:
        self._dram.clear()
        self._metas.clear()
        self._index = {t: TierIndex(t, i.capacity_bytes, self._metas) for t, i in self._index.items()}

    # --- moving blocks between tiers ---------------------------------------------------------

    def _use(self, h: BlockHash, meta: BlockMeta) -> None:
        self._clock.use(meta, 1.0)
        self._index[meta.tier].rekeyed(h, meta)

    def _lookup(self, h: BlockHash) -> bytes | None:
        meta = self._metas.get(h)
        if meta is None:
            self._n["num_misses"] += 1
            return None
        if meta.prefetched:
            meta.prefetched = False
            self._n["num_prefetch_used"] += 1
        if meta.read_counted:  # by a prefetch
            meta.read_counted = False
        else:
            self._use(h, meta)
        if meta.tier == "dram":
            self._n["num_hits_dram"] += 1
            self._n["bytes_served_dram"] += meta.size
            return self._dram.get(h)
        assert self._disk is not None
        payload = self._disk.read(h)
        if payload is None:
            self._forget_corrupt(h, meta)
            self._n["num_misses"] += 1
            return None
        self._n["num_hits_disk"] += 1
        self._n["bytes_served_disk"] += meta.size
        self._promote(h, meta, payload)
        return payload

    def _place_new(self, h: BlockHash, meta: BlockMeta, payload: bytes) -> str | None:
        """Puts a new block in DRAM, else on disk; the tier that took it, or None."""
        self._metas[h] = meta
        for tier in ("dram", "disk"):
            if self._admit(tier, h, meta, payload):
                return tier
        del self._metas[h]
        return None

    def _promote(self, h: BlockHash, meta: BlockMeta, payload: bytes) -> bool:
        """Moves a disk block to DRAM if DRAM admits it; else it stays on disk."""
        assert meta.tier == "disk"
        victims = self._plan("dram", meta)
        if victims is None:
            return False
        self._take_out(h, meta)  # frees its disk bytes before DRAM spills into the disk tier
        self._enter("dram", h, meta, payload, victims)
        self._n["bytes_promoted"] += meta.size
        return True

    def _admit(self, tier: Tier, h: BlockHash, meta: BlockMeta, payload: bytes) -> bool:
        """Stores a block that is indexed but in no tier into `tier`, displacing what it must;
        False: refused, or the disk write failed (the caller decides its fate)."""
        if tier not in self._index:  # no disk tier
            return False
        victims = self._plan(tier, meta)
        return victims is not None and self._enter(tier, h, meta, payload, victims)

    def _plan(self, tier: Tier, meta: BlockMeta) -> list[tuple[BlockHash, EvictionReason]] | None:
        """`TierIndex.plan_room` for `meta`; a refusal is counted and is None."""
        plan = self._index[tier].plan_room(meta.tenant, meta.size, (meta.key, meta.seq), self._shares)
        if isinstance(plan, str):
            self._n[f"num_{tier}_refused"] += 1
            if plan == "at_max":
                self._n[f"num_{tier}_refused_at_max"] += 1
            return None
        return plan

    def _enter(self, tier: Tier, h: BlockHash, meta: BlockMeta, payload: bytes,
               victims: list[tuple[BlockHash, EvictionReason]]) -> bool:
        self._evict(tier, victims)
        if tier == "disk":
            assert self._disk is not None
            if not self._disk.insert(h, payload):  # a failing disk loses this block only
                return False
        else:
            self._dram.insert(h, payload)
        meta.tier = tier
        self._clock.rekey(meta)  # a new sequence number: heap entries from its last stay here go stale
        self._index[tier].add(h, meta)
        return True

    def _evict(self, tier: Tier, victims: list[tuple[BlockHash, EvictionReason]]) -> None:
        for victim, reason in victims:
            meta = self._metas[victim]
            payload = self._take_out(victim, meta)
            self._n[f"num_{tier}_evictions"] += 1
            if reason != "value":
                self._n[f"num_{tier}_evictions_{reason}"] += 1
            if payload is not None and self._admit("disk", victim, meta, payload):
                self._n["bytes_spilled"] += meta.size
                continue
            del self._metas[victim]

    def _take_out(self, h: BlockHash, meta: BlockMeta) -> bytes | None:
        """Removes a block from its tier (returns the payload if it was in DRAM); `meta` stays
        indexed, in no tier, until the caller places or forgets it."""
        self._index[meta.tier].discard(meta)
        if meta.tier == "disk":
            assert self._disk is not None
            self._disk.pop(h)
            return None
        if meta.prefetched:
            meta.prefetched = False
            self._n["num_prefetch_wasted"] += 1
        return self._dram.pop(h)

    def _forget_corrupt(self, h: BlockHash, meta: BlockMeta) -> None:
        """A disk block whose file failed its checks (the disk tier already dropped it)."""
        self._index["disk"].discard(meta)
        del self._metas[h]

    # --- queries (never count as use) -------------------------------------------------------

    def match_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading hashes present in any tier."""
        n = 0
        for h in hashes:
            if not self.contains(h):
                break
            n += 1
        return n

    def contains(self, block_hash: BlockHash) -> bool:
        return check_block_hash(block_hash) in self._metas

    def holdings(self, incarnation: str | None = None, seq: int = 0) -> dict[str, object]:
        """The prefix blocks this store holds (shadows left out: nobody else's prompt has their
        keys), for the scheduler's prefix index, as numbered changes (`actors/holdings.py`): those
        after change `seq` of `incarnation` (this store's process), or the whole set when they are
        not all kept. Plain types: {"incarnation", "seq", "changes": [[seq, added, removed]],
        "full": list or None}. O(blocks held) per call."""
        self._holdings.update(h for h, m in self._metas.items() if not m.shadow)
        read = self._holdings.read(incarnation, seq)
        return {"incarnation": read.incarnation, "seq": read.seq,
                "changes": [[n, list(added), list(removed)] for n, added, removed in read.changes],
                "full": None if read.full is None else list(read.full)}

    def dram_eviction_order(self) -> list[BlockHash]:
        """DRAM's blocks, the first to leave first (least valuable; least recent in "lru" mode)."""
        return self._index["dram"].order()

    def disk_eviction_order(self) -> list[BlockHash]:
        return self._index["disk"].order() if "disk" in self._index else []

    def disk_path(self, block_hash: BlockHash) -> Path | None:
        """Where a disk-tier block's file lives (None without a disk tier)."""
        return self._disk.path_of(check_block_hash(block_hash)) if self._disk is not None else None

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        """Payload bytes each tenant holds per tier: {tenant: {"dram_bytes", "disk_bytes"}}."""
        tenants = {t for index in self._index.values() for t in index.usage}
        return {t: {f"{tier}_bytes": self._index[tier].usage.get(t, 0) if tier in self._index else 0
                    for tier in ("dram", "disk")} for t in sorted(tenants)}

    def stats(self) -> PrefixCacheStats:
        disk = self._disk
        return PrefixCacheStats(
            **{name: self._n[name] for name in _COUNTERS},
            num_corrupt=0 if disk is None else disk.num_corrupt,
            num_disk_write_errors=0 if disk is None else disk.num_write_errors,
            num_dram_blocks=len(self._dram),
            # `is None`, not truthiness: an empty tier has len() 0 but still counts.
            num_disk_blocks=0 if disk is None else len(disk),
            dram_bytes=self._dram.used_bytes,
            disk_bytes=0 if disk is None else disk.used_bytes,
        )

    def stats_dict(self) -> dict[str, int]:
        """`stats()` as plain ints, for callers in other processes."""
        return self.stats().to_dict()

    def check_integrity(self) -> None:
        self._dram.check_integrity()
        for index in self._index.values():
            index.check_integrity()
        assert len(self._dram) == len(self._index["dram"]), "DRAM payloads differ from its index"
        assert all(h in self._dram for h, m in self._metas.items() if m.tier == "dram"), "DRAM index"
        assert all(not m.prefetched or m.tier == "dram" for m in self._metas.values()), "prefetched off DRAM"
        if self._disk is not None:
            self._disk.check_integrity()
            assert self._disk.used_bytes == self._index["disk"].used_bytes, "disk index bytes"
            assert all(h in self._disk for h, m in self._metas.items() if m.tier == "disk"), "disk index"
        else:
            assert all(m.tier == "dram" for m in self._metas.values()), "a block on a disk tier that is off"
