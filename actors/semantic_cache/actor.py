"""Ray at the edge of the semantic cache: the service as an actor, and a handle with deadlines.

Mental model: `SemanticCacheActor` is `SemanticCacheService` run in its own process, built there
with the MiniLM embedder (a loaded model must not be pickled across), so the model is loaded once
however many ingress replicas call it. It is an async actor: concurrent `lookup_many` calls from
all callers meet in the service's batcher and share one embedding forward. It saves on the
service's timer, on `close()`, and at a graceful exit (`__ray_terminate__`: atexit runs); a killed
one keeps what its last save wrote, and a crashed one is restarted (up to `MAX_RESTARTS`)
and reloads it. `RaySemanticCache` adapts a handle to the `SemanticCache`
contract, each call bounded by `timeout_s`, Ray's failures turned into `SemanticCacheUnavailable`.
`start_semantic_cache` / `stop_semantic_cache` are the owner's side: start and wait for the load,
save and kill. This file is the only one in the package that imports Ray.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
from typing import Any

import numpy as np
import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError

from actors.semantic_cache.config import SemanticCacheConfig
from actors.semantic_cache.embedder import MiniLMEmbedder
from actors.semantic_cache.entry import CachedResponse, CacheKey, EntryId
from actors.semantic_cache.service import Query, SemanticCacheService, SemanticCacheUnavailable, ServiceConfig
from actors.semantic_cache.stats import SemanticCacheStats
from actors.semantic_cache.worker import Lookup, SemanticCacheWorker

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0  # torch + the model in a fresh process on a busy 2-core box
STOP_TIMEOUT_S = 30.0


class _ActorService(SemanticCacheService):
    def __init__(self, cache_cfg: SemanticCacheConfig, cfg: ServiceConfig, torch_threads: int | None = 1) -> None:
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        worker = SemanticCacheWorker(cache_cfg, MiniLMEmbedder(), folder=cfg.folder, save_every=cfg.save_every)
        super().__init__(worker, cfg)
        atexit.register(self._save_at_exit)

    async def ready(self) -> int:
        """Answers once the model is loaded and saved entries reloaded: how many there are."""
        return (await self.stats()).size

    def _save_at_exit(self) -> None:
        try:
            self.worker.save()
        except Exception:
            logger.exception("semantic cache: save at exit failed")


# No CPU reserved: it must never be what keeps the embedded default from fitting on 2 cores.
# A crashed actor is restarted by Ray and reloads its folder's last save (its __init__ does); the
# calls that meet it while it restarts fail as `SemanticCacheUnavailable`, i.e. are served as misses.
MAX_RESTARTS = 3
SemanticCacheActor = ray.remote(num_cpus=0, max_restarts=MAX_RESTARTS)(_ActorService)


class RaySemanticCache:
    """`SemanticCache` over an actor handle; it does not own the actor (`close` saves only)."""

    def __init__(self, actor: ActorHandle, timeout_s: float = 5.0) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    async def lookup_many(self, queries: list[Query]) -> list[Lookup]:
        return await self._call("lookup_many", queries)

    async def insert(self, key: CacheKey, text: str, response: CachedResponse,
                     vector: np.ndarray | None = None) -> EntryId | None:
        return await self._call("insert", key, text, response, vector)

    async def stats(self) -> SemanticCacheStats:
        return await self._call("stats")

    async def save(self) -> None:
        await self._call("save")

    async def close(self) -> None:
        await self.save()

    async def _call(self, method: str, *args: Any) -> Any:
        ref = getattr(self.actor, method).remote(*args)
        try:
            return await asyncio.wait_for(ref, self.timeout_s)  # type: ignore[arg-type]
        except asyncio.TimeoutError as e:
            ray.cancel(ref)
            raise SemanticCacheUnavailable(f"{method}: no answer within {self.timeout_s:g} s") from e
        except RayActorError as e:
            raise SemanticCacheUnavailable(f"{method}: {str(e).splitlines()[0] if str(e) else 'actor died'}") from e


def start_semantic_cache(cache_cfg: SemanticCacheConfig, cfg: ServiceConfig, *, name: str | None = None,
                         timeout_s: float = START_TIMEOUT_S) -> ActorHandle:
    """A new cache actor (named `name`, which must be free), returned once it has loaded the model
    and reloaded `cfg.folder`; killed again if that does not happen within `timeout_s`."""
    actor = SemanticCacheActor.options(name=name).remote(cache_cfg, cfg)  # type: ignore[attr-defined]
    try:
        num_entries = ray.get(actor.ready.remote(), timeout=timeout_s)
    except BaseException:
        ray.kill(actor, no_restart=True)
        raise
    logger.info("semantic cache actor %s up with %d entries from %s", name or "", num_entries, cfg.folder)
    return actor


def stop_semantic_cache(actor: ActorHandle, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Saves the actor's entries (bounded by `timeout_s`; a dead or hung actor keeps its last
    save) and kills it."""
    try:
        ray.get(actor.close.remote(), timeout=timeout_s)
    except (GetTimeoutError, RayActorError) as e:
        logger.warning("semantic cache actor not saved on stop: %r", e)
    ray.kill(actor, no_restart=True)
