"""Prefix reuse of one rate by tier: the engines' own caches, the pool's DRAM, the pool's disk.

Mental model: two sources, each exact for what it counts, joined in one row.
- The request timelines (bench/loadgen/stages.py) say how many prompt tokens of the answered
  requests were reused rather than computed (`prefix_hit_tokens`), and for each handed-off prompt
  how many blocks its prefill worker imported from the pool (`pool_hit_blocks`). What is left is
  the engines' own caches: `local_hit_tokens = prefix_hit_tokens - pool_hit_blocks x block_size`
  (a prompt a decode worker prefilled itself counts whole there, pool imports included: its
  timeline does not split them).
- The pool's stores count every block lookup they answer, by the tier that answered, from the
  moment they start; `/health`'s `prefix_pool` section sums them over the stores that answered
  (deploy/pool_source.py). Two readings around a rate give the blocks the pool served during it,
  per tier, exactly: `pool_dram_tokens`, `pool_disk_tokens` (x block_size). They are at least the
  prefill imports: stores also serve decode workers prefilling for themselves, resumes from KV
  shadows, blocks past another store's first miss (fetched, then dropped) and fetches an engine
  had no free block for. A block a prefetch moved up from disk before it was read counts as DRAM.
The block size is the engines' (`/health` workers' kv_plan), else EngineConfig's default. The
tier figures are None (unknown, not zero) without a pool section (peers, prefix_cache.num_stores:
0), when it reports an error or predates the per-tier counts, when the stores that answered
differ between the readings, or when a counter went backwards (a store restarted).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from actors.engine.config import EngineConfig

TIERS = ("dram", "disk")
DEFAULT_BLOCK_SIZE = EngineConfig.block_size


@dataclass(frozen=True)
class PoolReading:
    """One reading of the pool's cumulative lookup counters (summed over the stores that answered)."""

    hit_blocks: dict[str, int]  # tier -> block lookups it answered
    miss_blocks: int  # block lookups no tier answered
    stores_answered: int

    @staticmethod
    def of(health: Mapping[str, Any]) -> PoolReading | None:
        """From a `/health` answer; None when it has no usable `prefix_pool` section."""
        section = health.get("prefix_pool")
        if not isinstance(section, Mapping):
            return None
        hits, misses, stores = section.get("hit_blocks"), section.get("miss_blocks"), section.get("stores_answered")
        if not isinstance(hits, Mapping) or not all(isinstance(hits.get(t), int) for t in TIERS):
            return None
        if not isinstance(misses, int) or not isinstance(stores, int):
            return None
        return PoolReading({t: int(hits[t]) for t in TIERS}, misses, stores)


def pool_delta(before: PoolReading | None, after: PoolReading | None) -> dict[str, int] | None:
    """Block lookups during the window, {"dram", "disk", "miss"}; None when it cannot be told."""
    if before is None or after is None or before.stores_answered != after.stores_answered:
        return None
    out = {t: after.hit_blocks[t] - before.hit_blocks[t] for t in TIERS}
    out["miss"] = after.miss_blocks - before.miss_blocks
    return out if min(out.values()) >= 0 else None


def block_size_of(workers_kv_plans: list[Mapping[str, Any] | None]) -> int | None:
    """The engines' block size from the workers' `kv_plan`s (the first that says), or None."""
    for plan in workers_kv_plans:
        size = plan.get("block_size") if plan else None
        if isinstance(size, int) and size > 0:
            return size
    return None


def tier_tokens(stages: Mapping[str, Any], delta: Mapping[str, int] | None, block_size: int | None) -> dict[str, Any]:
    """The tier figures of one rate, to add to its stage figures (`summarize_stages`)."""
    bs = block_size or DEFAULT_BLOCK_SIZE
    imported = int(stages.get("pool_hit_blocks") or 0) * bs
    reused = int(stages.get("prefix_hit_tokens") or 0)
    return {
        "block_size": bs,
        "local_hit_tokens": max(0, reused - imported),
        "pool_hit_tokens": imported,
        "pool_dram_tokens": None if delta is None else delta["dram"] * bs,
        "pool_disk_tokens": None if delta is None else delta["disk"] * bs,
        "pool_lookups": None if delta is None else dict(delta),  # blocks: hits per tier, and misses
    }
