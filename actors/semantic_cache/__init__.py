"""Semantic cache: reuse a finished response when a new prompt means the same as a stored one.

Mental model, bottom up: `entry` (keys, responses, decaying scores) <- `index` (one hnswlib cosine
index per partition) <- `store` (partitions, threshold, decay, capacity, stats) <- `persist`
(save/reload) <- `worker` (embedder + store) <- `actor` (Ray wrapper). Import `actor` only where Ray
is wanted.
"""

from actors.semantic_cache.config import InvalidSemanticCacheConfig, SemanticCacheConfig
from actors.semantic_cache.entry import CachedResponse, CacheKey, Entry, EntryId
from actors.semantic_cache.stats import SemanticCacheStats

__all__ = ["CacheKey", "CachedResponse", "Entry", "EntryId", "InvalidSemanticCacheConfig",
           "SemanticCacheConfig", "SemanticCacheStats"]
