"""The prefix pool's holdings as numbered changes: the log, one store, and the pool's fan-out."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.engine.block_hash import BlockHash, hash_block_chain
from actors.holdings import HoldingsLog
from actors.prefix_cache.handles import LocalStoreHandle
from actors.prefix_cache.pool import DROPPED, PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore

CHAIN = hash_block_chain(list(range(64)), 4)  # 16 blocks


def blob(h: BlockHash) -> bytes:
    return h.to_bytes(16, "little") * 4


def test_log_gives_changes_after_a_cursor_or_the_whole_set() -> None:
    log = HoldingsLog(max_changes=2, incarnation="a")
    assert not log.update(frozenset())  # nothing changed, nothing numbered
    assert log.update({1, 2}) and log.update({2, 3}) and log.seq == 2
    got = log.read("a", 0)
    assert got.full is None and [(n, set(a), set(r)) for n, a, r in got.changes] == [(1, {1, 2}, set()), (2, {3}, {1})]
    assert log.read("a", 2).changes == () and log.read("a", 2).full is None  # up to date
    log.update({3})
    assert log.read("a", 0).full == frozenset({3})  # change 1 is no longer kept: the whole set
    assert log.read("a", 1).changes[-1] == (3, (), (2,))
    assert log.read("b", 3).full == frozenset({3}) and log.read(None, 0).full == frozenset({3})
    assert log.read("a", 9).full == frozenset({3})  # a cursor from the future is of no use either


def test_store_reports_prefix_blocks_not_shadows_and_follows_evictions(tmp_path: Path) -> None:
    store = PrefixCacheStore(PrefixCacheConfig(dram_bytes=64 * 4, enable_disk=False), "s0")
    first = store.holdings()
    assert first["full"] == [] and first["seq"] == 0
    store.put([(h, blob(h)) for h in CHAIN[:3]])
    store.put([(CHAIN[10], blob(CHAIN[10]))], shadow=True)  # a running request's private KV shadow
    got = store.holdings(first["incarnation"], 0)
    assert got["full"] is None and len(got["changes"]) == 1
    assert set(got["changes"][0][1]) == set(CHAIN[:3]) and got["changes"][0][2] == []
    store.put([(h, blob(h)) for h in CHAIN[3:6]], depths=[3, 4, 5])  # DRAM holds 4: some leave
    after = store.holdings(first["incarnation"], got["seq"])
    held = set(CHAIN[:3])
    for _, added, removed in after["changes"]:
        held = (held | set(added)) - set(removed)
    assert held == {h for h in CHAIN if store.contains(h)} - {CHAIN[10]}
    assert set(store.holdings()["full"]) == held  # a reader without a cursor gets the same, whole


@pytest.fixture
def handles(tmp_path: Path) -> dict[StoreId, LocalStoreHandle]:
    cfg = PrefixCacheConfig(dram_bytes=64 * 40, enable_disk=False)
    out = {StoreId(f"s{i}"): LocalStoreHandle(PrefixCacheStore(cfg, f"s{i}")) for i in range(3)}
    yield out
    for handle in out.values():
        handle.store.close()


def test_pool_reads_each_store_after_its_cursor_and_a_dropped_one_as_empty(
        handles: dict[StoreId, LocalStoreHandle]) -> None:
    pool = PrefixCachePool(handles)
    pool.put([(h, blob(h)) for h in CHAIN]).wait()
    whole = pool.holdings({})
    assert set(whole) == {"s0", "s1", "s2"}
    assert set().union(*(r.full or () for r in whole.values())) == set(CHAIN)
    for store_id, read in whole.items():
        assert read.full == {h for h in CHAIN if pool.owner(h) == store_id}
    cursors = {s: (r.incarnation, r.seq) for s, r in whole.items()}
    assert all(r.changes == () and r.full is None for r in pool.holdings(cursors).values())
    pool.remove(CHAIN[8:]).wait()
    removed = {h for r in pool.holdings(cursors).values() for _, _, gone in r.changes for h in gone}
    assert removed == set(CHAIN[8:])
    dead = pool.owner(CHAIN[0])
    handles[dead].fail()
    assert pool.match_prefix(CHAIN) == 0  # the pool drops it
    after = pool.holdings(cursors)
    assert after[dead].incarnation == DROPPED and after[dead].full == frozenset()
