"""A prefix-cache store's settings, and the checks every store and pool call makes on its input.

Mental model: one frozen `PrefixCacheConfig` per store (a pool's stores share one): the two
tiers' bounds and place, and how blocks are ranked (`value.py`) and shared between tenants.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from actors.engine.block_hash import BlockHash
from actors.engine.fetch import ferry_home
from actors.engine.shares import TenantShares

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class PrefixCacheConfig:
    # Sizes as shifts, not transfer.units: importing transfer loads torch, which the store actors never need.
    dram_bytes: int = 256 << 20
    disk_bytes: int = 1 << 30
    disk_dir: str | None = None  # root of every store's folder; None -> $FERRY_HOME/prefix_cache
    enable_disk: bool = True
    eviction: Literal["value", "lru"] = "value"  # "lru": plain recency, the baseline
    half_life_bytes: int | None = None  # traffic that halves a block's use count; None: dram_bytes
    depth_scale_blocks: float = 32.0  # a block this deep in its chain weighs half a first block
    shadow_weight: float = 0.125  # a KV shadow's weight: a request's private blocks, rarely read
    tenant_shares: TenantShares = field(default_factory=TenantShares)  # of each tier's bytes

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise ValueError(f"dram_bytes must be positive, got {self.dram_bytes}")
        if self.enable_disk and self.disk_bytes <= 0:
            raise ValueError(f"disk_bytes must be positive when the disk tier is on, got {self.disk_bytes}")
        if self.eviction not in ("value", "lru"):
            raise ValueError(f"eviction is 'value' or 'lru', got {self.eviction!r}")
        if self.half_life_bytes is not None and self.half_life_bytes <= 0:
            raise ValueError(f"half_life_bytes must be positive, got {self.half_life_bytes}")
        if self.depth_scale_blocks <= 0 or not 0 < self.shadow_weight <= 1:
            raise ValueError(f"need depth_scale_blocks > 0 and 0 < shadow_weight <= 1, got "
                             f"{self.depth_scale_blocks}, {self.shadow_weight}")

    def store_dir(self, store_id: str) -> Path:
        root = Path(self.disk_dir).expanduser() if self.disk_dir else ferry_home() / "prefix_cache"
        return root / store_id


def check_block_hash(block_hash: object) -> BlockHash:
    valid = isinstance(block_hash, int) and not isinstance(block_hash, bool) and 0 <= block_hash < 1 << 128
    if not valid:
        raise ValueError(f"a block hash is an int in [0, 2**128), got {block_hash!r}")
    return BlockHash(block_hash)
