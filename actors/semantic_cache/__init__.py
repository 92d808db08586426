"""Semantic cache: reuse a finished response when a new prompt means the same as a stored one.

Mental model, bottom up: `entry` (keys, responses, decaying scores) <- `index` (one hnswlib cosine
index per partition) <- `store` (partitions, threshold, decay, capacity, stats) <- `persist`
(save/reload) <- `worker` (embedder + store, synchronous) <- `service` (the async `SemanticCache`
contract: lookups batched across callers by `batcher`, saves on a timer and on close) <- `actor`
(the service as a Ray actor, and `RaySemanticCache` over its handle). Import `actor` only where Ray
is wanted.
"""

from actors.semantic_cache.config import InvalidSemanticCacheConfig, SemanticCacheConfig
from actors.semantic_cache.entry import CachedResponse, CacheKey, Entry, EntryId
from actors.semantic_cache.stats import SemanticCacheStats

__all__ = ["CacheKey", "CachedResponse", "Entry", "EntryId", "InvalidSemanticCacheConfig",
           "SemanticCacheConfig", "SemanticCacheStats"]
