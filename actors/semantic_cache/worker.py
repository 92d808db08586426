"""`SemanticCacheWorker`: embedder + store + persistence behind text-in, text-out calls.

Mental model: this is the object the HTTP layer (or a Ray actor wrapping it) talks to. `lookup_many`
embeds a batch of prompts in one forward and looks each up in its own partition; a miss hands back
its vector so the insert after generation does not embed the prompt again. Saving is explicit
(`save`) and also happens every `save_every` inserts, so a crash loses at most that many; `dirty`
says whether anything a save would write (entries, scores refreshed by hits) changed since the
last one, for a caller that saves on a timer (service.py). The worker is synchronous and
thread-safe; event loops talk to it through `SemanticCacheService`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from actors.semantic_cache.config import SemanticCacheConfig
from actors.semantic_cache.embedder import Embedder
from actors.semantic_cache.entry import CachedResponse, CacheKey, EntryId
from actors.semantic_cache.persist import load_store, save_store
from actors.semantic_cache.stats import SemanticCacheStats
from actors.semantic_cache.store import Clock, Hit, SemanticStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lookup:
    hit: Hit | None
    vector: np.ndarray  # [dim]; pass back to `insert` after a miss
    best_similarity: float | None


class SemanticCacheWorker:
    def __init__(self, cfg: SemanticCacheConfig, embedder: Embedder, *, folder: Path | None = None,
                 save_every: int = 64, clock: Clock | None = None) -> None:
        if embedder.dim != cfg.dim:
            raise ValueError(f"embedder width {embedder.dim} != configured dim {cfg.dim}")
        self.cfg = cfg
        self.embedder = embedder
        self.folder = folder
        self.save_every = save_every
        self.store = load_store(cfg, folder, clock=clock) if folder is not None else (
            SemanticStore(cfg, clock=clock) if clock is not None else SemanticStore(cfg))
        self._lock = threading.Lock()  # the store and hnswlib index are not safe for concurrent writes
        self._unsaved = 0  # inserts since the last save
        self._dirty = False  # anything saved (entries, scores) changed since the last save
        self._num_embed_batches = 0
        self._num_embedded = 0
        if len(self.store):
            logger.info("semantic cache: %d entries reloaded from %s", len(self.store), folder)

    def lookup_many(self, queries: list[tuple[CacheKey, str]]) -> list[Lookup]:
        """Each (key, text) looked up in its own partition, all texts embedded in one forward."""
        vectors = self._embed([text for _, text in queries])  # [n, dim]
        results = []
        with self._lock:
            for (key, _), vector in zip(queries, vectors):
                hit, best = self.store.lookup(key, vector)
                self._dirty |= hit is not None  # a hit refreshed the entry's score
                results.append(Lookup(hit, vector, best))
        return results

    def _embed(self, texts: list[str]) -> np.ndarray:
        vectors = self.embedder.embed(texts)
        with self._lock:
            self._num_embed_batches += 1
            self._num_embedded += len(texts)
        return vectors

    def lookup(self, key: CacheKey, text: str) -> Lookup:
        return self.lookup_many([(key, text)])[0]

    def insert(self, key: CacheKey, text: str, response: CachedResponse, *, vector: np.ndarray | None = None,
               pinned: bool = False) -> EntryId | None:
        if vector is None:
            vector = self._embed([text])[0]
        with self._lock:
            entry_id = self.store.insert(key, vector, text, response, pinned=pinned)
            self._unsaved += 1
            self._dirty = True
            if self.folder is not None and self._unsaved >= self.save_every:
                self._save_locked()
        return entry_id

    def pin(self, key: CacheKey, entry_id: EntryId, pinned: bool = True) -> None:
        with self._lock:
            self.store.pin(key, entry_id, pinned)
            self._dirty = True

    @property
    def dirty(self) -> bool:
        return self._dirty

    def save(self) -> None:
        with self._lock:
            self._save_locked()

    def _save_locked(self) -> None:
        if self.folder is not None:
            save_store(self.store, self.folder)
            self._unsaved, self._dirty = 0, False

    def stats(self) -> SemanticCacheStats:
        with self._lock:
            return replace(self.store.snapshot_stats(), num_embed_batches=self._num_embed_batches,
                           num_embedded=self._num_embedded)
