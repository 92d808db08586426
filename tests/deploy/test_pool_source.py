"""The ingress's view of the prefix-cache pool (deploy/pool_source.py) over plain stores in this
process (no Ray): `/health`'s `prefix_pool` section carries cumulative lookups per tier, so two
readings can be differenced (bench.serve does, around each rate)."""

from __future__ import annotations

import asyncio

from actors.engine.block_hash import hash_block_chain
from actors.prefix_cache.handles import LocalStoreHandle
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from deploy.pool_source import PoolSource

# `handles`: 3 plain stores whose DRAM holds 4 blocks of 64 bytes each and disk the rest, so
# reading the whole chain back hits both tiers (the pool tests' fixture)
from tests.actors.prefix_cache.test_pool import handles  # noqa: F401  (a fixture)

CHAIN = hash_block_chain(list(range(96)), 4)  # 24 blocks
BLOCK = bytes(64)


def test_health_counts_lookups_per_tier_since_the_stores_started(handles: dict[StoreId, LocalStoreHandle]) -> None:
    source = PoolSource(handles)
    first = asyncio.run(source.health())
    assert (first["hit_blocks"], first["miss_blocks"], first["stores_answered"]) == ({"dram": 0, "disk": 0}, 0, 3)

    pool = PrefixCachePool(handles)
    assert pool.put([(h, BLOCK) for h in CHAIN]).wait() == 24
    assert len(pool.get_prefix(CHAIN)) == 24
    assert pool.get_prefix(hash_block_chain(list(range(1000, 1008)), 4)) == []  # 2 blocks no store holds
    per_store = [h.store.stats() for h in handles.values()]
    dram, disk = sum(s.num_hits_dram for s in per_store), sum(s.num_hits_disk for s in per_store)
    second = asyncio.run(source.health())
    assert second["hit_blocks"] == {"dram": dram, "disk": disk} and dram + disk == 24 and dram > 0 and disk > 0
    # each owner of the unknown chain stops at its own first miss: one miss per owner asked
    owners = {pool.owner(h) for h in hash_block_chain(list(range(1000, 1008)), 4)}
    assert second["miss_blocks"] == len(owners) and second["stores_answered"] == 3
    assert second["hit_rate"] == round(24 / (24 + len(owners)), 3)  # the rates are still there, from the same counts


def test_a_store_that_does_not_answer_drops_out_of_the_sums(handles: dict[StoreId, LocalStoreHandle]) -> None:
    source = PoolSource(handles)
    pool = PrefixCachePool(handles)
    pool.put([(h, BLOCK) for h in CHAIN]).wait()
    pool.get_prefix(CHAIN)
    handles[StoreId("s1")].fail()
    got = asyncio.run(source.health())
    kept = [h.store.stats() for s, h in handles.items() if s != "s1"]
    assert got["stores_answered"] == 2
    assert got["hit_blocks"] == {"dram": sum(s.num_hits_dram for s in kept), "disk": sum(s.num_hits_disk for s in kept)}
    assert sum(got["hit_blocks"].values()) < 24  # s1's part is missing: a reader sees stores_answered change
