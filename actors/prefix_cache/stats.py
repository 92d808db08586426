"""Counters of a prefix-cache store, and of a pool of them (the field-wise sum).

Mental model: a frozen snapshot of plain ints, per tier where it matters: lookups answered by
each tier, bytes moved (put into, spilled down, promoted up, served from each tier), admissions a
tier refused, evictions by reason, and prefetches (promoted, then read, or evicted unread).
Stores in other processes send it as a dict of ints (`to_dict`) so no class of ours crosses a
process boundary; `from_dict` rebuilds it and rejects unknown or missing fields, so a version
skew between client and store fails loudly. Counters (`num_*` except the block counts, and
`bytes_*`) only grow; the gauges (`num_*_blocks`, `dram_bytes`, `disk_bytes`) describe the store
right now. `TenantUse` is one tenant's bytes per tier. deploy/ maps these to metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class PrefixCacheStats:
    num_puts: int = 0  # blocks newly stored (a put of a present key only counts as a use of it)
    num_put_refused: int = 0  # new blocks no tier took (larger than DRAM, or refused by both tiers)
    num_hits_dram: int = 0
    num_hits_disk: int = 0  # lookups answered from disk (promoted to DRAM when worth it)
    num_misses: int = 0  # lookups by get / get_prefix that found nothing usable
    num_dram_evictions: int = 0  # left DRAM for lack of room (spilled to disk if it took them)
    num_disk_evictions: int = 0  # files deleted for lack of room
    num_dram_evictions_share: int = 0  # of those, taken from a tenant above its guarantee for another
    num_disk_evictions_share: int = 0
    num_dram_evictions_own: int = 0  # of those, a tenant at its maximum making room for itself
    num_disk_evictions_own: int = 0
    num_dram_refused: int = 0  # blocks DRAM would not admit (put to disk instead, or left there)
    num_disk_refused: int = 0  # blocks disk would not admit (dropped)
    num_dram_refused_at_max: int = 0  # of those, because their tenant was at its maximum there
    num_disk_refused_at_max: int = 0
    num_prefetched: int = 0  # disk blocks a prefetch promoted to DRAM
    num_prefetch_used: int = 0  # of those, read before leaving DRAM
    num_prefetch_wasted: int = 0  # of those, left DRAM unread
    num_corrupt: int = 0  # disk files found missing, torn or failing their checksum
    num_disk_write_errors: int = 0  # blocks lost to a failing write
    bytes_put_dram: int = 0  # payload bytes of new blocks, by the tier that took them
    bytes_put_disk: int = 0
    bytes_spilled: int = 0  # DRAM -> disk
    bytes_promoted: int = 0  # disk -> DRAM (hits and prefetches)
    bytes_served_dram: int = 0  # payload bytes returned by lookups, by answering tier
    bytes_served_disk: int = 0
    num_dram_blocks: int = 0
    num_disk_blocks: int = 0
    dram_bytes: int = 0  # payload bytes
    disk_bytes: int = 0  # payload bytes (file headers not counted)

    @property
    def num_hits(self) -> int:
        return self.num_hits_dram + self.num_hits_disk

    @property
    def hit_rate(self) -> float:
        lookups = self.num_hits + self.num_misses
        return self.num_hits / lookups if lookups else 0.0

    @property
    def dram_hit_rate(self) -> float:
        """Of all lookups, the share DRAM answered."""
        lookups = self.num_hits + self.num_misses
        return self.num_hits_dram / lookups if lookups else 0.0

    @property
    def disk_hit_rate(self) -> float:
        """Of the lookups DRAM could not answer, the share disk did."""
        lookups = self.num_hits_disk + self.num_misses
        return self.num_hits_disk / lookups if lookups else 0.0

    @property
    def prefetch_accuracy(self) -> float:
        """Prefetched blocks read before leaving DRAM, per prefetched block."""
        return self.num_prefetch_used / self.num_prefetched if self.num_prefetched else 0.0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, int]) -> PrefixCacheStats:
        names = {f.name for f in fields(cls)}
        if set(values) != names:
            raise ValueError(f"stats fields differ: got {sorted(values)}, expected {sorted(names)}")
        return cls(**{name: int(values[name]) for name in names})

    @classmethod
    def total(cls, parts: Iterable[PrefixCacheStats]) -> PrefixCacheStats:
        sums = dict.fromkeys((f.name for f in fields(cls)), 0)
        for part in parts:
            for name, value in asdict(part).items():
                sums[name] += value
        return cls(**sums)


@dataclass(frozen=True)
class TenantUse:
    """The payload bytes one tenant holds in each tier (of a store, or summed over a pool)."""

    dram_bytes: int = 0
    disk_bytes: int = 0

    @classmethod
    def total_by_tenant(cls, parts: Iterable[Mapping[str, Mapping[str, int]]]) -> dict[str, TenantUse]:
        """Sums stores' `tenant_usage()` answers (tenant -> {"dram_bytes", "disk_bytes"})."""
        sums: dict[str, TenantUse] = {}
        for part in parts:
            for tenant, use in part.items():
                have = sums.get(tenant, cls())
                sums[tenant] = cls(have.dram_bytes + int(use["dram_bytes"]), have.disk_bytes + int(use["disk_bytes"]))
        return dict(sorted(sums.items()))
