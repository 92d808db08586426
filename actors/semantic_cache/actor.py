"""`SemanticCacheActor`: the worker as a Ray actor, one per node or per model.

Mental model: the actor owns the one embedding model and the indexes of its process; every ingress
replica calls it, so concurrent lookups from many replicas are batched into one forward by Ray's
own queueing (`max_concurrency` 1 keeps the store single-writer). The class is the plain worker;
`make_semantic_cache_actor` builds it with the MiniLM embedder inside the actor's process, because
a loaded model must not be pickled across.
"""

from __future__ import annotations

from pathlib import Path

import ray

from actors.semantic_cache.config import SemanticCacheConfig
from actors.semantic_cache.embedder import MiniLMEmbedder
from actors.semantic_cache.worker import SemanticCacheWorker


class _MiniLMWorker(SemanticCacheWorker):
    def __init__(self, cfg: SemanticCacheConfig, folder: Path | None = None, save_every: int = 64) -> None:
        super().__init__(cfg, MiniLMEmbedder(), folder=folder, save_every=save_every)


SemanticCacheActor = ray.remote(num_cpus=0)(_MiniLMWorker)


def make_semantic_cache_actor(cfg: SemanticCacheConfig, folder: Path | None = None,
                              name: str | None = None) -> "ray.actor.ActorHandle":
    options = {"name": name, "get_if_exists": True} if name else {}
    return SemanticCacheActor.options(**options).remote(cfg, folder)  # type: ignore[attr-defined]
