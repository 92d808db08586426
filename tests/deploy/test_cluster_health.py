"""`/health` of the cluster backend: healthy means a request can be served now; a worker down
while others of its kind serve is "degraded" (named, with the replacements under way); each worker
says how its KV pool was sized."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from actors.engine.memory import KVPlan
from actors.messages import WorkerLoad
from cluster.router.config import RouterConfig
from cluster.router.room import RoomQueue
from deploy.cluster_backend import ClusterBackend, can_serve


def load(name: str, kind: str, healthy: bool = True, rss_bytes: int = 0) -> WorkerLoad:
    return WorkerLoad(name, kind, 1, 0, 0, 90, 100, 0.01, healthy, rss_bytes)  # type: ignore[arg-type]


class Replacements:
    def __init__(self, replacing: tuple[str, ...]) -> None:
        self.replacing = dict.fromkeys(replacing)


class Client:
    """What `ClusterBackend.health` reads of a `Router`."""

    control = None

    def __init__(self, loads: list[WorkerLoad], replacing: tuple[str, ...] = ()) -> None:
        self._loads = {w.name: w for w in loads}
        self.replacements = Replacements(replacing)
        self.room = RoomQueue()
        self.cfg = RouterConfig(room_wait_s=30.0, room_max_wait_s=300.0)

    def capacity_coming(self) -> bool:
        return bool(self.replacements.replacing)

    async def loads(self) -> dict[str, WorkerLoad]:
        return self._loads


def health(loads: list[WorkerLoad], replacing: tuple[str, ...] = ()) -> dict[str, Any]:
    return asyncio.run(ClusterBackend(Client(loads, replacing), None, "m", 100).health())  # type: ignore[arg-type]


def test_a_worker_down_beside_a_healthy_one_of_its_kind_is_degraded_not_unhealthy() -> None:
    report = health([load("p0", "prefill"), load("d0", "decode", False), load("d1", "decode")], ("d0",))
    assert report["healthy"] is True and report["degraded"] == {"down": ["d0"], "replacing": ["d0"]}
    assert report["workers"]["d0"]["healthy"] is False and report["workers"]["d1"]["running"] == 1


def test_no_healthy_worker_of_a_needed_kind_is_unhealthy() -> None:
    assert health([load("p0", "prefill"), load("d0", "decode", False)])["healthy"] is False
    assert health([load("p0", "prefill", False), load("d0", "decode")])["healthy"] is False
    assert health([])["healthy"] is False
    all_up = health([load("p0", "prefill"), load("d0", "decode")])
    assert all_up["healthy"] is True and "degraded" not in all_up
    assert can_serve([load("c0", "colocated", False), load("c1", "colocated")])  # no prefill workers needed
    assert not can_serve([load("p0", "prefill")])


def test_each_worker_reports_its_resident_memory_when_known() -> None:
    report = health([load("p0", "prefill", rss_bytes=1500 << 20), load("d0", "decode")])
    assert report["workers"]["p0"]["rss_mib"] == 1500
    assert report["workers"]["d0"]["rss_mib"] is None  # a load that did not say (0): unknown, not zero


def test_requests_waiting_for_a_decode_row_are_reported() -> None:
    async def main() -> dict[str, Any]:
        client = Client([load("p0", "prefill"), load("d0", "decode")])
        client.room.join(1, 0.0)
        return await ClusterBackend(client, None, "m", 100).health()  # type: ignore[arg-type]

    queue = asyncio.run(main())["row_queue"]
    assert queue.pop("oldest_wait_s") >= 0
    assert queue == {"waiting": 1, "num_queued": 1, "interactive_waiting": False, "capacity_coming": False,
                     "stall_after_s": 30.0, "max_wait_s": 300.0}
    assert health([load("d0", "decode")])["row_queue"]["waiting"] == 0


def test_each_worker_reports_how_its_kv_pool_was_sized() -> None:
    plan = KVPlan("planned", device="cuda:0", num_blocks=4096, block_size=16, bytes_per_block=368_640,
                  kv_bytes=4096 * 368_640, weights_bytes=270 << 20, free_bytes=60 << 30,
                  activation_peak_bytes=300 << 20, fraction=0.9, share=0.5)
    report = health([replace(load("p0", "prefill"), kv_plan=plan), load("d0", "decode")])
    assert report["workers"]["p0"]["kv_plan"] == plan.to_dict()
    got = report["workers"]["p0"]["kv_plan"]
    assert (got["source"], got["device"], got["num_blocks"], got["max_tokens"]) == ("planned", "cuda:0", 4096, 65536)
    assert report["workers"]["d0"]["kv_plan"] is None  # a load without one (a worker that is down): unknown
    assert json.loads(json.dumps(report)) == report  # the plan travels as JSON-able figures


def test_health_reports_the_prefix_pool_and_each_tenants_part_of_its_tiers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from actors.prefix_cache.config import PrefixCacheConfig
    from actors.prefix_cache.handles import LocalStoreHandle
    from actors.prefix_cache.store import PrefixCacheStore
    from deploy.pool_source import PoolSource

    cfg = PrefixCacheConfig(dram_bytes=4 << 20, disk_bytes=8 << 20, disk_dir=str(tmp_path))
    store = PrefixCacheStore(cfg, "s0")
    block = bytes(1 << 20)
    store.put([(1, block), (2, block)], tenant="chat")
    store.put([(3, block)], tenant="bulk")
    assert store.get_prefix([1, 2, 9]) and store.get_prefix([7]) == []
    backend = ClusterBackend(Client([load("p0", "prefill"), load("d0", "decode")]), None, "m", 100,  # type: ignore[arg-type]
                             pool=PoolSource({"s0": LocalStoreHandle(store)}))
    pool = asyncio.run(backend.health())["prefix_pool"]
    assert pool["by_tenant"] == {"chat": {"dram_mib": 2.0, "disk_mib": 0.0}, "bulk": {"dram_mib": 1.0, "disk_mib": 0.0}}
    assert pool["dram_mib"] == 3.0 and pool["hit_rate"] == round(2 / 4, 3)  # 2 hits, 2 misses (9, then 7)
