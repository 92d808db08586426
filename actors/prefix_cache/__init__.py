"""The prefix-cache pool: KV blocks keyed by chained block hash, sharded over store actors.

`PrefixCacheStore` (one store: DRAM + disk tiers), `HashRing` (which store owns a hash),
`PrefixCachePool` (the client over N stores). The Ray wrapper lives in `actor.py` and is not
imported here, so using the package never requires Ray.
"""

from actors.prefix_cache.handles import LocalStoreHandle, StoreHandle, StoreTimeout, StoreUnavailable
from actors.prefix_cache.pool import PendingPut, PoolStats, PrefixCachePool
from actors.prefix_cache.ring import HashRing, StoreId
from actors.prefix_cache.stats import PrefixCacheStats, TenantUse
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore

__all__ = [
    "HashRing",
    "LocalStoreHandle",
    "PendingPut",
    "PoolStats",
    "PrefixCacheConfig",
    "PrefixCachePool",
    "PrefixCacheStats",
    "PrefixCacheStore",
    "StoreHandle",
    "StoreId",
    "StoreTimeout",
    "StoreUnavailable",
    "TenantUse",
]
