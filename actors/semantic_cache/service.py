"""`SemanticCache`, the async contract the HTTP layer calls, and `SemanticCacheService`, its
in-process implementation.

Mental model: the worker is synchronous and thread-safe; the service is what an event loop talks
to. Lookups from concurrent callers go through one `LookupBatcher`, so they share an embedding
forward; inserts, stats and saves run on threads so the loop never waits on the model, hnswlib or
the disk. Saving happens every `save_every` inserts (the worker), every `save_interval_s` while
anything changed (a task on the loop, started by the first call), and on `close()`: a clean
shutdown loses nothing, a crash at most one interval. The Ray actor (actor.py) is this class in
its own process, and `RaySemanticCache` is the same contract over the actor's handle.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from actors.semantic_cache.batcher import LookupBatcher
from actors.semantic_cache.config import SemanticCacheConfig
from actors.semantic_cache.embedder import Embedder
from actors.semantic_cache.entry import CachedResponse, CacheKey, EntryId
from actors.semantic_cache.stats import SemanticCacheStats
from actors.semantic_cache.worker import Lookup, SemanticCacheWorker

logger = logging.getLogger(__name__)

Query = tuple[CacheKey, str]


class SemanticCacheUnavailable(RuntimeError):
    """The cache did not answer in time or is gone; callers serve the request as a miss."""


@dataclass(frozen=True)
class ServiceConfig:
    folder: Path | None = None  # where the index and entries are saved; None: never saved
    save_every: int = 64  # inserts between saves
    save_interval_s: float | None = 60.0  # a save this often while anything changed; None: no timer
    batch_window_s: float = 0.002  # how long a lookup waits for others to share its forward

    def __post_init__(self) -> None:
        assert self.save_every >= 1 and self.batch_window_s >= 0, self
        assert self.save_interval_s is None or self.save_interval_s > 0, self


class SemanticCache(Protocol):
    """The semantic cache as an event loop sees it; every method is a coroutine, safe to call
    concurrently. `lookup_many` answers each (key, text) from its own partition only, in order
    (a miss carries the prompt's vector for `insert`); `insert` stores a finished answer, embedding
    the text unless `vector` is given, and returns its id, or None when the cache is full of
    pinned entries; `stats` is a snapshot; `save` writes the index and entries to the folder now
    (nothing without one); `close` saves and stops periodic saving (calls still work afterwards,
    unsaved until the next save). Failures raise: `SemanticCacheUnavailable` for a cache that did
    not answer in time or is gone."""

    async def lookup_many(self, queries: list[Query]) -> list[Lookup]: ...

    async def insert(self, key: CacheKey, text: str, response: CachedResponse,
                     vector: np.ndarray | None = None) -> EntryId | None: ...

    async def stats(self) -> SemanticCacheStats: ...

    async def save(self) -> None: ...

    async def close(self) -> None: ...


class SemanticCacheService:
    def __init__(self, worker: SemanticCacheWorker, cfg: ServiceConfig) -> None:
        self.worker = worker
        self.cfg = cfg
        self._batcher: LookupBatcher[Query, Lookup] = LookupBatcher(
            worker.lookup_many, cfg.batch_window_s)
        self._saver: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    def open(cls, cache_cfg: SemanticCacheConfig, cfg: ServiceConfig, embedder: Embedder) -> "SemanticCacheService":
        """A service over a worker that reloads whatever `cfg.folder` holds."""
        return cls(SemanticCacheWorker(cache_cfg, embedder, folder=cfg.folder, save_every=cfg.save_every), cfg)

    async def lookup_many(self, queries: list[Query]) -> list[Lookup]:
        self._start_saver()
        return await self._batcher.submit_many(queries)

    async def insert(self, key: CacheKey, text: str, response: CachedResponse,
                     vector: np.ndarray | None = None) -> EntryId | None:
        self._start_saver()
        return await asyncio.to_thread(self.worker.insert, key, text, response, vector=vector)

    async def stats(self) -> SemanticCacheStats:
        return await asyncio.to_thread(self.worker.stats)

    async def save(self) -> None:
        await asyncio.to_thread(self.worker.save)

    async def close(self) -> None:
        self._closed = True
        if self._saver is not None:
            self._saver.cancel()
            self._saver = None
        await self.save()

    def _start_saver(self) -> None:
        # Started by the first call rather than the constructor, which may run outside any loop.
        if self._saver is None and not self._closed and self.cfg.save_interval_s and self.cfg.folder:
            self._saver = asyncio.ensure_future(self._save_periodically(self.cfg.save_interval_s))

    async def _save_periodically(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if not self.worker.dirty:
                continue
            try:
                await self.save()
            except Exception:  # the next interval tries again; serving goes on
                logger.exception("periodic save of the semantic cache to %s failed", self.cfg.folder)
