"""The store actor on a real local Ray cluster with the real MiniLM in its process: lookups, inserts
and hits through `RaySemanticCache`, tenants isolated, concurrent callers sharing a forward; and
entries surviving every way the actor can end: stopped by its owner, a graceful exit, a kill after
the timer saved."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from actors.semantic_cache import CachedResponse, CacheKey, SemanticCacheConfig
from actors.semantic_cache.persist import MANIFEST
from actors.semantic_cache.service import SemanticCacheUnavailable, ServiceConfig
from tests.actors.semantic_cache.test_embedding import KEY, PARAPHRASES, STORED, THRESHOLD, UNRELATED

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CFG = SemanticCacheConfig(threshold=THRESHOLD)
OTHER_TENANT = CacheKey(KEY.model, "tenant-b", KEY.params_key)


def answer(i: int) -> CachedResponse:
    return CachedResponse(f"answer {i}", (i, i + 1), "stop")


_STARTED: list[Any] = []


@pytest.fixture(autouse=True)
def _kill_leftovers(ray_cluster: ModuleType) -> Iterator[None]:
    yield
    while _STARTED:  # a test that failed half-way leaves no actor behind
        ray_cluster.kill(_STARTED.pop(), no_restart=True)


def start(folder: Path, **kw: Any) -> Any:
    from actors.semantic_cache.actor import start_semantic_cache

    actor = start_semantic_cache(CFG, ServiceConfig(folder=folder, **kw), name=f"sc-test-{uuid.uuid4().hex[:8]}")
    _STARTED.append(actor)
    return actor


def cache_of(actor: Any) -> Any:
    from actors.semantic_cache.actor import RaySemanticCache

    return RaySemanticCache(actor, timeout_s=60.0)  # generous: the box is shared and has 2 cores


def wait_dead(ray: ModuleType, actor: Any, timeout_s: float = 60.0) -> None:
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.stats.remote(), timeout=5)
        except RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError("the actor still answers")


def hit_text(cache: Any, key: CacheKey, text: str) -> str | None:
    [lookup] = asyncio.run(cache.lookup_many([(key, text)]))
    return lookup.hit.response.text if lookup.hit is not None else None


def test_lookup_insert_hit_through_the_actor_tenants_isolated(ray_cluster: ModuleType, tmp_path: Path) -> None:
    from actors.semantic_cache.actor import stop_semantic_cache

    actor = start(tmp_path, batch_window_s=0.1, save_interval_s=None)
    cache = cache_of(actor)

    async def fill() -> None:
        for i, text in enumerate(STORED):
            [miss] = await cache.lookup_many([(KEY, text)])
            assert miss.hit is None
            assert await cache.insert(KEY, text, answer(i), miss.vector) == i  # the miss's vector, not re-embedded

    asyncio.run(fill())
    assert [hit_text(cache, KEY, p) for p in PARAPHRASES] == [f"answer {i}" for i in range(5)]
    assert [hit_text(cache, KEY, u) for u in UNRELATED] == [None] * 5
    assert hit_text(cache, OTHER_TENANT, STORED[0]) is None  # the very same prompt, another tenant
    stats = asyncio.run(cache.stats())
    assert (stats.num_lookups, stats.num_hits, stats.num_inserts, stats.size) == (16, 5, 5, 5)
    assert stats.num_embedded == 16  # inserts reused their lookup's vector

    # Separate callers' calls, in flight together, meet in the actor's batcher.
    refs = [actor.lookup_many.remote([(KEY, text)]) for text in PARAPHRASES]
    results = ray_cluster.get(refs, timeout=120)
    assert [r.hit.response.text for [r] in results] == [f"answer {i}" for i in range(5)]
    after = asyncio.run(cache.stats())
    assert after.num_embedded - stats.num_embedded == 5
    assert after.num_embed_batches - stats.num_embed_batches <= 2  # one each without batching: 5
    stop_semantic_cache(actor)


def test_restart_keeps_entries_however_the_actor_ended(ray_cluster: ModuleType, tmp_path: Path) -> None:
    from actors.semantic_cache.actor import stop_semantic_cache

    first = start(tmp_path, save_interval_s=None, save_every=1000)
    asyncio.run(cache_of(first).insert(KEY, STORED[0], answer(0)))
    stop_semantic_cache(first)  # the owner's stop: close (save), then kill

    second = start(tmp_path, save_interval_s=None, save_every=1000)
    assert ray_cluster.get(second.ready.remote(), timeout=60) == 1
    assert hit_text(cache_of(second), KEY, PARAPHRASES[0]) == "answer 0"
    asyncio.run(cache_of(second).insert(KEY, STORED[1], answer(1)))
    second.__ray_terminate__.remote()  # a graceful exit: atexit saves
    wait_dead(ray_cluster, second)

    third = start(tmp_path, save_interval_s=0.2, save_every=1000)
    assert ray_cluster.get(third.ready.remote(), timeout=60) == 2
    asyncio.run(cache_of(third).insert(KEY, STORED[2], answer(2)))
    deadline = time.monotonic() + 30
    while len([e for p in json.loads((tmp_path / MANIFEST).read_text())["partitions"] for e in p["entries"]]) < 3:
        assert time.monotonic() < deadline, "the timer never saved"
        time.sleep(0.1)
    ray_cluster.kill(third, no_restart=True)  # no chance to save: only the timer's save counts
    wait_dead(ray_cluster, third)
    with pytest.raises(SemanticCacheUnavailable):
        hit_text(cache_of(third), KEY, PARAPHRASES[2])

    fourth = start(tmp_path, save_interval_s=None)
    cache = cache_of(fourth)
    assert [hit_text(cache, KEY, p) for p in PARAPHRASES[:3]] == ["answer 0", "answer 1", "answer 2"]
    assert hit_text(cache, OTHER_TENANT, STORED[0]) is None
    stop_semantic_cache(fourth)


def test_a_crashed_actor_comes_back_with_its_last_save(ray_cluster: ModuleType, tmp_path: Path) -> None:
    from actors.semantic_cache.actor import stop_semantic_cache

    actor = start(tmp_path, save_interval_s=None, save_every=1)  # every insert saved
    cache = cache_of(actor)
    asyncio.run(cache.insert(KEY, STORED[0], answer(0)))
    ray_cluster.kill(actor, no_restart=False)  # a crash: Ray restarts it, the same handle serves on
    deadline = time.monotonic() + 240  # a fresh process loads torch + MiniLM on a busy 2-core box
    while True:
        try:
            if hit_text(cache, KEY, PARAPHRASES[0]) == "answer 0":
                break
        except SemanticCacheUnavailable:
            pass  # restarting: a miss to the caller
        assert time.monotonic() < deadline, "the restarted actor never served its saved entry"
        time.sleep(0.2)
    assert asyncio.run(cache.stats()).size == 1  # reloaded from the save, nothing duplicated
    stop_semantic_cache(actor)
