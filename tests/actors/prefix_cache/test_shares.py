"""Per-tenant shares of each pool tier: a flooding tenant evicts its own blocks, not a tenant within
its guarantee; a tenant within its guarantee claims room from one above it; a tenant at its
maximum evicts its own or is refused, even with room free; use per tenant, per store and pooled."""

from __future__ import annotations

from pathlib import Path

from actors.engine.block_hash import BlockHash, hash_block_chain
from actors.engine.shares import TenantShare, TenantShares
from actors.prefix_cache.handles import LocalStoreHandle
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.stats import TenantUse
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore

H = BlockHash
SIZE = 40


def blob(i: int) -> bytes:
    return i.to_bytes(16, "little") + bytes(SIZE - 16)


def make(tmp_path: Path, shares: dict[str, TenantShare], dram_blocks: int = 8, disk_blocks: int = 0,
         name: str = "s") -> PrefixCacheStore:
    cfg = PrefixCacheConfig(dram_bytes=dram_blocks * SIZE, disk_bytes=max(1, disk_blocks) * SIZE,
                            enable_disk=disk_blocks > 0, disk_dir=str(tmp_path),
                            tenant_shares=TenantShares.of_mapping(shares))
    return PrefixCacheStore(cfg, name)


def put(store: PrefixCacheStore, tenant: str, i: int, depth: int = 0, shadow: bool = False) -> int:
    n = store.put([(H(i), blob(i))], tenant=tenant, depths=[depth], shadow=shadow)
    store.check_integrity()
    return n


def test_a_flooding_tenant_evicts_only_its_own_once_the_other_is_within_its_guarantee(tmp_path: Path) -> None:
    survivors = {}
    for shares in ({"a": TenantShare(guaranteed=0.5)}, {}):
        store = make(tmp_path, shares, name=f"s{len(shares)}")
        assert store.put([(H(i), blob(i)) for i in range(4)], tenant="a") == 4  # half of DRAM: a's guarantee
        for i in range(100, 120):  # 20 unique chains' first blocks, newer than a's
            put(store, "flood", i)
        survivors[bool(shares)] = [i for i in range(4) if store.contains(H(i))]
        s = store.stats()
        assert (s.num_dram_evictions, s.num_dram_evictions_share, s.num_dram_evictions_own) == (16, 0, 0)
        if shares:
            assert store.tenant_usage() == {"a": {"dram_bytes": 160, "disk_bytes": 0},
                                            "flood": {"dram_bytes": 160, "disk_bytes": 0}}
        store.close()
    assert survivors == {True: [0, 1, 2, 3], False: []}  # without shares, value alone lets the flood win


def test_a_tenant_within_its_guarantee_claims_room_from_one_above_its_own(tmp_path: Path) -> None:
    for shares in ({"b": TenantShare(guaranteed=0.5)}, {}):
        store = make(tmp_path, shares, name=f"s{len(shares)}")
        for i in range(8):  # DRAM full of the flood's hot blocks
            put(store, "flood", 100 + i)
            store.get([H(100 + i)] * 3)
        stored = put(store, "b", 7, depth=40, shadow=True)  # a deep KV shadow, worth less than any of them
        s = store.stats()
        if shares:
            assert stored == 1 and s.num_dram_evictions_share == 1 and store.contains(H(7))
            assert store.tenant_usage()["b"] == {"dram_bytes": SIZE, "disk_bytes": 0}
        else:
            assert stored == 0 and s.num_dram_refused == 1 and s.num_put_refused == 1
            assert s.num_dram_refused_at_max == 0  # refused for its value, not for a share
        store.close()


def test_a_tenant_at_its_maximum_evicts_its_own_in_each_tier_or_is_refused(tmp_path: Path) -> None:
    store = make(tmp_path, {"flood": TenantShare(max=0.25)}, dram_blocks=8, disk_blocks=8)  # 2 blocks per tier
    store.put([(H(i), blob(i)) for i in range(2)], tenant="a")
    for i in range(100, 106):
        assert put(store, "flood", i) == 1
    assert store.dram_eviction_order() == [1, 0, 104, 105]
    assert sorted(store.disk_eviction_order()) == [102, 103]  # 100 and 101 were deleted for its newer ones
    s = store.stats()
    assert (s.num_dram_evictions, s.num_dram_evictions_own, s.num_disk_evictions, s.num_disk_evictions_own) == (
        4, 4, 2, 2)
    assert s.dram_bytes == 4 * SIZE  # half of DRAM is free, and the flood still may not have it
    assert put(store, "flood", 200, depth=100) == 0  # worth less than its own blocks in both tiers
    s = store.stats()
    assert (s.num_dram_refused, s.num_disk_refused, s.num_put_refused) == (1, 1, 1)
    assert (s.num_dram_refused_at_max, s.num_disk_refused_at_max) == (1, 1)  # the reason, per tier
    assert put(store, "a", 9) == 1 and store.contains(H(0))  # others are unaffected
    assert store.tenant_usage() == {"a": {"dram_bytes": 3 * SIZE, "disk_bytes": 0},
                                    "flood": {"dram_bytes": 2 * SIZE, "disk_bytes": 2 * SIZE}}
    store.close()


def test_the_pool_carries_tenant_and_depth_prefetches_and_sums_use_per_tenant(tmp_path: Path) -> None:
    cfg = PrefixCacheConfig(dram_bytes=4 * SIZE, disk_bytes=64 * SIZE, disk_dir=str(tmp_path))
    stores = {StoreId(f"s{i}"): LocalStoreHandle(PrefixCacheStore(cfg, f"s{i}")) for i in range(2)}
    pool = PrefixCachePool(stores)
    chain = hash_block_chain(list(range(64)), 4)  # 16 blocks
    assert pool.put([(h, blob(h % 1000)) for h in chain], tenant="a").wait() == 16
    other = hash_block_chain(list(range(500, 532)), 4)
    assert pool.put([(h, blob(h % 1000)) for h in other], tenant="b").wait() == 8
    use = pool.tenant_usage()
    assert list(use) == ["a", "b"] and all(isinstance(u, TenantUse) for u in use.values())
    assert use["a"].dram_bytes + use["a"].disk_bytes == 16 * SIZE
    assert use["b"].dram_bytes + use["b"].disk_bytes == 8 * SIZE
    on_disk = sum(1 for h in chain if h in stores[pool.owner(h)].store.disk_eviction_order())
    assert on_disk > 0
    # Each store got its part of the chain with its depth: its deepest blocks are the ones on disk.
    for store_id, handle in stores.items():
        mine = [h for h in chain if pool.owner(h) == store_id]
        on = handle.store.disk_eviction_order()
        assert [h for h in mine if h in on] == mine[len(mine) - len([h for h in mine if h in on]):]
    moved = pool.prefetch(chain).wait()
    assert moved > 0 and pool.stats().total.num_prefetched == moved
    for handle in stores.values():
        handle.store.check_integrity()
    pool.get_prefix(chain)
    total = pool.stats().total
    assert total.num_prefetch_used == moved and total.prefetch_accuracy == 1.0
