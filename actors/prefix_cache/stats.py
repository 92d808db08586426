"""Counters of a prefix-cache store, and of a pool of them (the field-wise sum).

Mental model: a frozen snapshot of plain ints. Stores in other processes send it as a dict of
ints (`to_dict`) so no class of ours crosses a process boundary; `from_dict` rebuilds it and
rejects unknown or missing fields, so a version skew between client and store fails loudly.
Counters (`num_*` except the block counts) only grow; the gauges (`num_*_blocks`, `*_bytes`)
describe the store right now. deploy/ maps these to metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class PrefixCacheStats:
    num_puts: int = 0  # blocks newly stored (a put of a present key only touches it)
    num_put_refused: int = 0  # blocks larger than the DRAM tier
    num_hits_dram: int = 0
    num_hits_disk: int = 0  # each one also promoted the block back to DRAM
    num_misses: int = 0  # lookups by get / get_prefix that found nothing usable
    num_dram_evictions: int = 0  # left DRAM for lack of room (spilled to disk if it is on)
    num_disk_evictions: int = 0  # files deleted for lack of room
    num_corrupt: int = 0  # disk files found missing, torn or failing their checksum
    num_disk_write_errors: int = 0  # spills lost to a failing write
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
