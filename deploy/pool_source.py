"""The prefix-cache pool as the ingress reads it: counters per tier for metrics, use per tenant for `/health`.

Mental model: the ingress started the store actors (or its deployment did) and holds their
handles; a `PoolSource` wraps a `PrefixCachePool` over them and answers off the event loop (the
pool's fan-out blocks for at most its own deadline). A store that does not answer counts as empty
this time, as for any pool call. The figures: each tier's hit rate, the bytes moved between
tiers, prefetch accuracy, refusals, and each tenant's bytes per tier (its share of the tiers,
`scheduler.tenants.<t>.kv_share_*`). `/health` also carries the cumulative block lookups by
answering tier and the number of stores that answered, so a client can difference two readings
(bench.serve does, around each rate); a store that did not answer drops out of the sums.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from actors.prefix_cache.handles import StoreHandle
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.stats import PrefixCacheStats, TenantUse

MIB = 1 << 20
TIMEOUT_S = 2.0


class PoolSource:
    def __init__(self, stores: Mapping[StoreId, StoreHandle], timeout_s: float = TIMEOUT_S) -> None:
        self.pool = PrefixCachePool(stores, timeout_s=timeout_s)

    async def stats(self) -> PrefixCacheStats:
        return (await asyncio.to_thread(self.pool.stats)).total

    async def tenant_usage(self) -> dict[str, TenantUse]:
        return await asyncio.to_thread(self.pool.tenant_usage)

    async def health(self) -> dict[str, Any]:
        """`/health`'s `prefix_pool` section."""
        pool, use = await asyncio.gather(asyncio.to_thread(self.pool.stats), self.tenant_usage())
        s = pool.total
        return {
            "dram_mib": round(s.dram_bytes / MIB, 1), "disk_mib": round(s.disk_bytes / MIB, 1),
            "hit_rate": round(s.hit_rate, 3), "dram_hit_rate": round(s.dram_hit_rate, 3),
            "disk_hit_rate": round(s.disk_hit_rate, 3), "prefetched_blocks": s.num_prefetched,
            "prefetch_accuracy": round(s.prefetch_accuracy, 3),
            # counters since each store started: block lookups by the tier that answered, and misses
            "hit_blocks": {"dram": s.num_hits_dram, "disk": s.num_hits_disk}, "miss_blocks": s.num_misses,
            "stores_answered": len(pool.per_store),
            "by_tenant": {t: {"dram_mib": round(u.dram_bytes / MIB, 1), "disk_mib": round(u.disk_bytes / MIB, 1)}
                          for t, u in use.items()},
        }
