"""The scheduler's prefix index learns what the shared prefix-cache pool holds, live: each store's
holdings are relayed by the ingress's link like a worker's telemetry, and placement prices the
pool's blocks as fetches. No Ray: the scheduler service and the stores are plain objects."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from actors.engine.sampling import SamplingParams
from actors.handoff import prompt_block_hashes
from actors.messages import GenerationRequest
from actors.messages import WorkerLoad as ActorLoad
from actors.prefix_cache.handles import LocalStoreHandle
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore
from cluster.config import SchedulerConfig
from cluster.descriptors import WorkerName, WorkerTelemetry
from cluster.placement import Placement, PlacementConfig
from cluster.prefix_index import POOL, PoolHoldings, PrefixIndex, pool_store
from cluster.router.link import SchedulerLink
from cluster.router.link_config import LinkConfig
from cluster.service import SchedulerService

S0, S1 = pool_store("s0"), pool_store("s1")


def test_pool_holder_is_the_union_of_its_stores() -> None:
    index = PrefixIndex()
    pool = PoolHoldings(index)
    pool.replace(S0, [1, 2, 3])
    pool.change(S1, [3, 4], [])  # a key moved to another store when the ring changed
    assert index.match((1, 2, 3, 4)) == {POOL: 4}
    pool.change(S0, [], [3])  # s0 lost it; s1 still holds it
    assert index.match((1, 2, 3, 4)) == {POOL: 4}
    pool.replace(S1, [])  # s1 restarted empty
    assert index.match((1, 2, 3)) == {POOL: 2} and pool.num_blocks(S1) == 0
    pool.change(S0, [], [1, 2, 9])
    assert index.match((1,)) == {}
    pool.check_integrity()
    index.check_integrity()


class _Local:
    """A scheduler actor handle over the plain `SchedulerService`, answering in this process."""

    def __init__(self, svc: SchedulerService) -> None:
        self.svc = svc

    def __getattr__(self, method: str) -> object:
        async def call(*args: object) -> object:
            return getattr(self.svc, method)(*args)

        return SimpleNamespace(remote=call)


class _Workers:
    def __init__(self, loads: list[ActorLoad]) -> None:
        self.lds = loads

    def in_flight(self) -> list[object]:
        return []

    async def loads(self) -> dict[str, ActorLoad]:
        return {w.name: w for w in self.lds}

    async def telemetry(self, cursors: object) -> dict[str, object]:
        return {}


def test_the_link_relays_pool_holdings_and_placement_fetches_them(tmp_path: Path) -> None:
    cfg = PrefixCacheConfig(dram_bytes=1 << 20, enable_disk=False)
    stores = {StoreId(f"s{i}"): LocalStoreHandle(PrefixCacheStore(cfg, f"s{i}")) for i in range(2)}
    pool = PrefixCachePool(stores)
    req = GenerationRequest("a", list(range(4, 4 + 40 * 16)), SamplingParams(max_tokens=8, temperature=0))
    hashes = prompt_block_hashes(req, 16)
    pool.put([(h, b"kv" * 8) for h in hashes[:30]]).wait()  # the pool has the first 30 of 40 blocks

    sched_cfg = SchedulerConfig(placement=PlacementConfig(hash_block_size=16, pool_fetch_s_per_block=1e-4),
                                heartbeat_timeout_s=60.0)
    svc = SchedulerService(sched_cfg)
    loads = [ActorLoad(n, "prefill" if n[0] == "p" else "decode", 0, 0, 0, 1000, 1000, 0.0, True)
             for n in ("p0", "d0")]

    async def main() -> Placement:
        link = SchedulerLink(_Local(svc), LinkConfig(telemetry_interval_s=0.01), sched_cfg)  # type: ignore[arg-type]
        link.attach(_Workers(loads))  # type: ignore[arg-type]
        link.attach_pool(pool.holdings)
        try:
            await link.report_once()  # the first round: each store's whole set
            pool.remove(hashes[20:30]).wait()
            await asyncio.sleep(0.02)
            await link.report_once()  # then only what changed, after the scheduler's cursors
            placed = await link.admit(req)
        finally:
            link.close()
        assert isinstance(placed, Placement)
        return placed

    placed = asyncio.run(main())
    sched = svc.sched
    assert sched.index.match(tuple(hashes)) == {POOL: 20}
    assert (placed.num_prefix_hit_blocks, placed.num_pool_blocks) == (20, 20)  # 20 fetched, 20 computed
    cursors = sched.telemetry.cursors()
    assert {n for n in cursors if n.startswith("<pool>/")} == {S0, S1}
    assert all(c[2] >= 1 for n, c in cursors.items() if n in (S0, S1))
    sched.check_integrity()
    # A store relayed with nothing (dropped, or restarted empty) takes its blocks out of the pool.
    for name in (S0, S1):
        sched.on_telemetry(WorkerTelemetry(WorkerName(name), "dropped", 1, (), 0, cached_full=frozenset()))
    assert sched.index.match(tuple(hashes)) == {}
