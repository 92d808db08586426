"""`SemanticStore`: partitions of (index, entries), decay and capacity, and the stats.

Mental model: a dict from `CacheKey` to a `Partition` (one `VectorIndex` plus its entries by id).
`lookup` looks in the request's own partition only, so a tenant, model or parameter set never sees
another's answers; the nearest live entry at or above the threshold is a hit, and the hit refreshes
its score (decayed value + 1, clock reset). `insert` first deletes what decayed below the floor, then,
if the hard bound is still reached, evicts the lowest score (ties: oldest refresh, then lowest id,
so the order is exact under a fake clock). Pinned entries are skipped by both. Vectors come in
already embedded: the store never loads a model, which keeps it cheap to test.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from actors.semantic_cache.config import SemanticCacheConfig
from actors.semantic_cache.entry import CachedResponse, CacheKey, Entry, EntryId
from actors.semantic_cache.index import VectorIndex
from actors.semantic_cache.stats import SemanticCacheStats

logger = logging.getLogger(__name__)

Clock = Callable[[], float]
_CANDIDATES = 4  # nearest neighbours examined per lookup; decayed ones are skipped, not returned


@dataclass
class Partition:
    index: VectorIndex
    entries: dict[EntryId, Entry] = field(default_factory=dict)
    next_id: int = 0


@dataclass(frozen=True)
class Hit:
    key: CacheKey
    entry_id: EntryId
    similarity: float
    response: CachedResponse
    prompt: str  # the stored prompt that matched


class SemanticStore:
    def __init__(self, cfg: SemanticCacheConfig, *, clock: Clock = time.time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.partitions: dict[CacheKey, Partition] = {}
        self.stats = SemanticCacheStats()

    def __len__(self) -> int:
        return sum(len(p.entries) for p in self.partitions.values())

    def lookup(self, key: CacheKey, vector: np.ndarray) -> tuple[Hit | None, float | None]:
        """(hit or None, best live similarity seen or None when the partition is empty)."""
        self.stats.num_lookups += 1
        part = self.partitions.get(key)
        if part is None:
            return None, None
        now = self.clock()
        best: float | None = None
        for label, similarity in part.index.nearest(vector, _CANDIDATES):
            entry = part.entries[EntryId(label)]
            if entry.score_at(now, self.cfg.half_life_s) < self.cfg.score_floor:
                self._delete(key, part, entry.entry_id)  # expired: never answer from it
                self.stats.num_evicted_decay += 1
                continue
            best = similarity if best is None else max(best, similarity)
            if similarity + 1e-6 >= self.cfg.threshold:  # float32 cosine of a vector with itself < 1
                self.stats.observe_similarity(similarity)
                self.stats.num_hits += 1
                entry.score = entry.score_at(now, self.cfg.half_life_s) + 1.0
                entry.refreshed_at = now
                entry.num_hits += 1
                return Hit(key, entry.entry_id, min(similarity, 1.0), entry.response, entry.prompt), similarity
            break  # candidates come best first: the next ones are further away still
        if best is not None:
            self.stats.observe_similarity(best)
        return None, best

    def insert(self, key: CacheKey, vector: np.ndarray, prompt: str, response: CachedResponse, *,
               pinned: bool = False) -> EntryId | None:
        """Stores a response; None when the cache is full of pinned entries (counted, not raised)."""
        now = self.clock()
        self.sweep()
        if len(self) >= self.cfg.max_entries and not self._evict_one(now):
            self.stats.num_refused_full += 1
            return None
        part = self.partitions.get(key)
        if part is None:
            part = self.partitions[key] = Partition(VectorIndex(self.cfg))
        entry_id = EntryId(part.next_id)
        part.next_id += 1
        part.index.add(entry_id, vector)
        part.entries[entry_id] = Entry(entry_id, prompt, response, 1.0, now, pinned)
        self.stats.num_inserts += 1
        self._refresh_size()
        return entry_id

    def pin(self, key: CacheKey, entry_id: EntryId, pinned: bool = True) -> None:
        entry = self.partitions[key].entries[entry_id]
        if not pinned and entry.pinned:
            entry.score, entry.refreshed_at = 1.0, self.clock()  # unpinned: decays from a fresh start
        entry.pinned = pinned
        self._refresh_size()

    def sweep(self) -> int:
        """Deletes every entry whose decayed score is below the floor; returns how many."""
        now = self.clock()
        doomed = [(key, e.entry_id) for key, part in self.partitions.items() for e in part.entries.values()
                  if e.score_at(now, self.cfg.half_life_s) < self.cfg.score_floor]
        for key, entry_id in doomed:
            self._delete(key, self.partitions[key], entry_id)
        self.stats.num_evicted_decay += len(doomed)
        return len(doomed)

    def eviction_order(self) -> list[tuple[CacheKey, EntryId]]:
        """Unpinned entries, first to be evicted first."""
        now = self.clock()
        ranked = sorted((e.score_at(now, self.cfg.half_life_s), e.refreshed_at, key, e.entry_id)
                        for key, part in self.partitions.items() for e in part.entries.values() if not e.pinned)
        return [(key, entry_id) for _, _, key, entry_id in ranked]

    def _evict_one(self, now: float) -> bool:
        order = self.eviction_order()
        if not order:
            return False
        key, entry_id = order[0]
        self._delete(key, self.partitions[key], entry_id)
        self.stats.num_evicted_capacity += 1
        return True

    def _delete(self, key: CacheKey, part: Partition, entry_id: EntryId) -> None:
        del part.entries[entry_id]
        part.index.delete(entry_id)
        self._refresh_size()

    def _refresh_size(self) -> None:
        self.stats.size = len(self)

    def snapshot_stats(self) -> SemanticCacheStats:
        self.stats.num_pinned = sum(e.pinned for p in self.partitions.values() for e in p.entries.values())
        return self.stats.copy()

    def check_integrity(self) -> None:
        for key, part in self.partitions.items():
            assert part.index.num_live == len(part.entries), (key, part.index.num_live, len(part.entries))
            assert all(e.entry_id < part.next_id for e in part.entries.values())
        assert len(self) <= self.cfg.max_entries, (len(self), self.cfg.max_entries)
        assert self.stats.size == len(self)
