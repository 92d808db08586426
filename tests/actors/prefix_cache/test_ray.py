"""The pool over real store actors: payloads cross processes intact; a killed or hung actor turns
into misses within the deadline, and the other actor keeps serving."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from types import ModuleType

import pytest

from actors.engine.block_hash import BlockHash, hash_block_chain
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore

pytestmark = pytest.mark.ray

CHAIN = hash_block_chain(list(range(64)), 4)  # 16 blocks
TIMEOUT_S = 2.0


def blob(h: BlockHash) -> bytes:
    return bytes(range(256)) + h.to_bytes(16, "little")  # every byte value, then the key


class HungStore(PrefixCacheStore):
    """A store whose lookups never come back in time."""

    def match_prefix(self, hashes: list[BlockHash]) -> int:
        time.sleep(30)
        return 0


def _wait_dead(ray: ModuleType, actor: object, timeout_s: float = 30.0) -> None:
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.stats_dict.remote(), timeout=5)  # type: ignore[attr-defined]
        except RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


def test_pool_over_actors_survives_a_killed_actor(ray_cluster: ModuleType, tmp_path: Path) -> None:
    ray = ray_cluster
    from actors.prefix_cache.actor import start_store_actors
    from actors.prefix_cache.pool import PrefixCachePool

    cfg = PrefixCacheConfig(dram_bytes=272 * 4, disk_bytes=1 << 20, disk_dir=str(tmp_path))
    handles = start_store_actors(cfg, 2, id_prefix=f"pc-{uuid.uuid4().hex[:8]}")
    try:
        pool = PrefixCachePool(handles, timeout_s=TIMEOUT_S)
        ids = sorted(handles)
        assert pool.put([(h, blob(h)) for h in CHAIN]).wait(timeout_s=60) == 16  # first call: actor start
        assert pool.match_prefix(CHAIN) == 16
        use = pool.tenant_usage()["default"]
        assert use.dram_bytes + use.disk_bytes == sum(len(blob(h)) for h in CHAIN)
        moved = pool.prefetch(CHAIN).wait(timeout_s=30)
        assert pool.get_prefix(CHAIN) == [blob(h) for h in CHAIN]  # some came back from disk
        stats = pool.stats()
        assert stats.total.num_prefetched == stats.total.num_prefetch_used == moved
        assert [stats.per_store[s].num_puts for s in ids] == [
            sum(1 for h in CHAIN if pool.owner(h) == s) for s in ids
        ]
        assert stats.total.num_hits == 16 and stats.total.num_hits_disk > 0

        victim, survivor = pool.owner(CHAIN[3]), next(s for s in ids if s != pool.owner(CHAIN[3]))
        first_victim = next(i for i, h in enumerate(CHAIN) if pool.owner(h) == victim)
        survivor_keys = [h for h in CHAIN if pool.owner(h) == survivor]
        ray.kill(handles[victim].actor, no_restart=True)
        _wait_dead(ray, handles[victim].actor)  # ray.kill is asynchronous: a call right after may still land

        start = time.monotonic()
        assert pool.match_prefix(CHAIN) == first_victim  # misses, not an exception
        assert time.monotonic() - start < TIMEOUT_S + 1.0
        assert pool.failed_store_ids == (victim,) and pool.store_ids == [survivor]
        assert pool.get_prefix(CHAIN) == [blob(h) for h in CHAIN[:first_victim]]
        assert all(pool.get_prefix([h]) == [blob(h)] for h in survivor_keys)
        assert list(pool.stats().per_store) == [survivor]
    finally:
        for handle in handles.values():
            ray.kill(handle.actor, no_restart=True)


class SlowRestartStore(PrefixCacheStore):
    """A store whose restart takes `RESTART_S` (a marker file tells a restart from the first start),
    so calls during it fail or time out for certain."""

    RESTART_S = 6.0

    def __init__(self, cfg: PrefixCacheConfig, store_id: str, marker: str) -> None:
        if Path(marker).exists():
            time.sleep(self.RESTART_S)
        Path(marker).touch()
        super().__init__(cfg, store_id)


def test_a_crashed_store_actor_is_restarted_and_rejoins_the_pool(ray_cluster: ModuleType, tmp_path: Path) -> None:
    ray = ray_cluster
    from actors.prefix_cache.actor import RayStoreHandle
    from actors.prefix_cache.pool import PrefixCachePool
    from actors.prefix_cache.ring import StoreId

    cfg = PrefixCacheConfig(dram_bytes=1 << 16, disk_bytes=1 << 20, disk_dir=str(tmp_path))
    ids = [StoreId(f"crash-{uuid.uuid4().hex[:6]}-{i}") for i in range(2)]
    actor_class = ray.remote(num_cpus=0.1, max_restarts=-1)(SlowRestartStore)  # as PrefixCacheActor
    handles = {s: RayStoreHandle(actor_class.remote(cfg, s, str(tmp_path / f"{s}.started"))) for s in ids}
    try:
        pool = PrefixCachePool(handles, timeout_s=TIMEOUT_S, retry_s=0.5)
        assert pool.put([(h, blob(h)) for h in CHAIN]).wait(60) == 16
        victim = pool.owner(CHAIN[0])
        ray.kill(handles[victim].actor, no_restart=False)  # a crash: Ray restarts the actor
        deadline = time.monotonic() + 60
        while pool.failed_store_ids != (victim,):  # ray.kill is asynchronous: the first calls may still land
            assert time.monotonic() < deadline, "the crashed store was never dropped"
            pool.match_prefix(CHAIN)
        while victim not in pool.store_ids:  # each call looks at the probe an earlier one started
            assert time.monotonic() < deadline, "the restarted store never rejoined"
            pool.match_prefix([])
            time.sleep(0.2)
        assert pool.failed_store_ids == () and pool.num_rejoined == 1
        assert pool.match_prefix(CHAIN) == 0  # it came back empty: its blocks are misses
        assert pool.put([(h, blob(h)) for h in CHAIN]).wait(30) == sum(1 for h in CHAIN if pool.owner(h) == victim)
        assert pool.get_prefix(CHAIN) == [blob(h) for h in CHAIN]  # the same handle serves on
    finally:
        for handle in handles.values():
            ray.kill(handle.actor, no_restart=True)


def test_hung_actor_times_out_into_misses(ray_cluster: ModuleType, tmp_path: Path) -> None:
    ray = ray_cluster
    from actors.prefix_cache.actor import RayStoreHandle
    from actors.prefix_cache.pool import PrefixCachePool
    from actors.prefix_cache.ring import StoreId

    cfg = PrefixCacheConfig(dram_bytes=1 << 16, enable_disk=False, disk_dir=str(tmp_path))
    hung = ray.remote(num_cpus=0.1)(HungStore).remote(cfg, "hung")
    ray.get(hung.contains.remote(0), timeout=60)  # started and answering
    try:
        pool = PrefixCachePool({StoreId("hung"): RayStoreHandle(hung)}, timeout_s=0.5)
        start = time.monotonic()
        assert pool.match_prefix(CHAIN) == 0
        assert 0.45 <= time.monotonic() - start < 1.5  # ray.get rounds its timeout down a little
        assert pool.failed_store_ids == ("hung",)
    finally:
        ray.kill(hung, no_restart=True)
