"""`PoolLink` measures what a block from the prefix-cache pool costs to fetch: per fetch that
returned blocks, its wall time over its blocks, smoothed; misses and empty fetches measure nothing.
The pools here are plain stores in this process; a store handle that advances a fake clock (or
sleeps) on every `get_prefix` stands for a slow link."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from actors.engine.block_hash import hash_block_chain
from actors.pool_link import FETCH_WEIGHT, PoolLink
from actors.prefix_cache.handles import LocalStoreHandle, PendingCall, StoreMethod
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore
from transfer.codec import KVLayout

LAYOUT = KVLayout("tiny", 2, 2, 8, 4)  # 2 layers, 2 KV heads, head_dim 8, 4 tokens a block
HASHES = hash_block_chain(list(range(4 * 4)), 4)  # a chain of 4 full blocks


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class SlowHandle:
    """A local store whose `get_prefix` takes `delay_s`: on the fake clock when given one, else asleep."""

    def __init__(self, inner: LocalStoreHandle, delay_s: float, clock: FakeClock | None = None) -> None:
        self.inner, self.delay_s, self.clock = inner, delay_s, clock

    def call(self, method: StoreMethod, *args: object) -> PendingCall:
        if method == "get_prefix":
            if self.clock is not None:
                self.clock.now += self.delay_s
            else:
                time.sleep(self.delay_s)
        return self.inner.call(method, *args)


def make_stores(tmp_path: Path, n: int) -> dict[StoreId, PrefixCacheStore]:
    cfg = PrefixCacheConfig(dram_bytes=1 << 20, disk_bytes=1 << 22, disk_dir=str(tmp_path))
    return {StoreId(f"s{i}"): PrefixCacheStore(cfg, f"s{i}") for i in range(n)}


def random_kv(num_blocks: int) -> torch.Tensor:
    torch.manual_seed(num_blocks)
    return torch.randn(LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def put_chain(pool: PrefixCachePool) -> torch.Tensor:
    kv = random_kv(len(HASHES))
    link = PoolLink(pool, LAYOUT)
    try:
        assert link.offer(HASHES, kv, tenant="acme") and link.flush(10.0)
        assert link.stats().num_stored_blocks == len(HASHES)
    finally:
        link.close()
    return kv


def test_seconds_per_block_come_from_fetches_that_return_blocks_and_are_smoothed(tmp_path: Path) -> None:
    clock = FakeClock()
    (store_id, store), = make_stores(tmp_path, 1).items()
    slow = SlowHandle(LocalStoreHandle(store), 0.0, clock)
    pool = PrefixCachePool({store_id: slow}, timeout_s=2.0)
    link = PoolLink(pool, LAYOUT, clock=clock)
    try:
        assert link.fetch_s_per_block is None
        stats = link.stats()
        assert (stats.num_timed_fetches, stats.fetch_s_per_block) == (0, None)
        slow.delay_s = 1.0
        assert link.fetch([]) == ([], None)  # nothing asked: the pool is not called
        assert clock.now == 100.0
        got, kv = link.fetch(HASHES)  # nothing stored yet: a miss, however long it took
        assert (got, kv) == ([], None) and clock.now == 101.0
        assert link.fetch_s_per_block is None and link.stats().num_timed_fetches == 0

        want = put_chain(pool)
        slow.delay_s = 0.4
        got, kv = link.fetch(HASHES)
        assert got == HASHES and kv is not None and torch.equal(kv, want)
        assert link.fetch_s_per_block == pytest.approx(0.1)  # the first fetch is taken as measured
        slow.delay_s = 1.0
        got, _ = link.fetch(HASHES[:2])  # 0.5 s a block, smoothed with 0.1
        assert got == HASHES[:2]
        smoothed = 0.1 + FETCH_WEIGHT * (0.5 - 0.1)
        assert link.fetch_s_per_block == pytest.approx(smoothed)
        # Blocks of another epoch are a miss (stale shadows): the time spent measures nothing.
        assert link.fetch(HASHES, epoch=7) == ([], None)
        stats = link.stats()
        assert (stats.num_fetched_blocks, stats.num_timed_fetches) == (6, 2)
        assert stats.fetch_s_per_block == pytest.approx(smoothed) == link.fetch_s_per_block
    finally:
        link.close()


def test_a_slow_link_measures_slower_than_a_fast_one_to_the_same_stores(tmp_path: Path) -> None:
    """Two links to the same two stores, one through handles that sleep on every fetch: real wall
    time, so only relationships are asserted (the sleep bounds the slow link's time from below)."""
    stores = make_stores(tmp_path, 2)
    delay_s = 0.1
    fast_pool = PrefixCachePool({s: LocalStoreHandle(st) for s, st in stores.items()}, timeout_s=5.0)
    slow_pool = PrefixCachePool({s: SlowHandle(LocalStoreHandle(st), delay_s) for s, st in stores.items()},
                                timeout_s=5.0)
    want = put_chain(fast_pool)
    fast, slow = PoolLink(fast_pool, LAYOUT), PoolLink(slow_pool, LAYOUT)
    try:
        for _ in range(3):
            for link in (fast, slow):
                got, kv = link.fetch(HASHES)
                assert got == HASHES and kv is not None and torch.equal(kv, want)
        fast_s, slow_s = fast.fetch_s_per_block, slow.fetch_s_per_block
        assert fast_s is not None and slow_s is not None
        assert slow_s >= delay_s / len(HASHES)  # each fetch slept at least once (the stores share the chain)
        assert 0 < fast_s < slow_s
        assert fast.stats().num_timed_fetches == slow.stats().num_timed_fetches == 3
    finally:
        fast.close()
        slow.close()
