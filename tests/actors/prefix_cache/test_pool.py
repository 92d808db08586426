"""The pool over 3 plain stores (no Ray): routing, chain semantics, failures as misses, deadlines."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from actors.engine.block_hash import BlockHash, hash_block_chain
from actors.prefix_cache.handles import LocalStoreHandle, PendingCall, StoreMethod, StoreTimeout
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore

CHAIN = hash_block_chain(list(range(96)), 4)  # 24 blocks


def blob(h: BlockHash) -> bytes:
    return h.to_bytes(16, "little") * 4  # 64 bytes, unique per hash


@pytest.fixture
def handles(tmp_path: Path) -> dict[StoreId, LocalStoreHandle]:
    cfg = PrefixCacheConfig(dram_bytes=64 * 4, disk_bytes=64 * 40, disk_dir=str(tmp_path))
    out = {StoreId(f"s{i}"): LocalStoreHandle(PrefixCacheStore(cfg, f"s{i}")) for i in range(3)}
    yield out
    for handle in out.values():
        handle.store.close()


def test_put_match_get_route_each_block_to_its_owner(handles: dict[StoreId, LocalStoreHandle]) -> None:
    pool = PrefixCachePool(handles)
    assert pool.match_prefix(CHAIN) == 0 and pool.get_prefix(CHAIN) == []
    assert pool.put([(h, blob(h)) for h in CHAIN]).wait() == 24
    for store_id, handle in handles.items():
        mine = [h for h in CHAIN if pool.owner(h) == store_id]
        assert mine and all(handle.store.contains(h) for h in mine)
        assert handle.store.stats().num_puts == len(mine)
        handle.store.check_integrity()
    assert pool.match_prefix(CHAIN) == 24
    assert pool.get_prefix(CHAIN) == [blob(h) for h in CHAIN]  # some of it came back from disk
    assert pool.put([(CHAIN[0], blob(CHAIN[0]))]).wait() == 0  # already there

    stats = pool.stats()
    assert stats.total.num_puts == 24 and stats.total.num_hits == 24 and stats.total.num_misses == 3
    assert stats.total.num_hits_disk > 0 and sorted(stats.per_store) == ["s0", "s1", "s2"]
    assert stats.failed_store_ids == ()


def test_chain_is_usable_only_up_to_its_first_miss(handles: dict[StoreId, LocalStoreHandle]) -> None:
    pool = PrefixCachePool(handles)
    pool.put([(h, blob(h)) for h in CHAIN])
    hole = CHAIN[9]
    assert handles[pool.owner(hole)].store.remove([hole]) == 1
    assert pool.match_prefix(CHAIN) == 9
    assert pool.get_prefix(CHAIN) == [blob(h) for h in CHAIN[:9]]
    assert pool.match_prefix(CHAIN[10:]) == 14  # the rest is still there, just unreachable as a prefix


def test_failed_store_becomes_misses_others_still_hit(
    handles: dict[StoreId, LocalStoreHandle], caplog: pytest.LogCaptureFixture
) -> None:
    pool = PrefixCachePool(handles)
    pool.put([(h, blob(h)) for h in CHAIN]).wait()
    dead = pool.owner(CHAIN[0])
    first_dead = 0
    dead_keys = [h for h in CHAIN if pool.owner(h) == dead]
    live_keys = [h for h in CHAIN if pool.owner(h) != dead]
    handles[dead].fail()

    with caplog.at_level(logging.WARNING, logger="actors.prefix_cache.pool"):
        assert pool.match_prefix(CHAIN) == first_dead
        assert pool.get_prefix(CHAIN) == []
        for h in live_keys:  # the survivors keep serving their own keys
            assert pool.get_prefix([h]) == [blob(h)]
        for h in dead_keys:  # now routed to a survivor, which never had them
            assert pool.owner(h) != dead and pool.match_prefix([h]) == 0
        assert pool.put([(h, blob(h)) for h in dead_keys]).wait() == len(dead_keys)
    assert [r.message.split()[2] for r in caplog.records] == [dead]  # logged once
    assert pool.store_ids == sorted(set(handles) - {dead}) and pool.failed_store_ids == (dead,)
    assert pool.match_prefix(CHAIN) == 24  # recomputed blocks re-put on the survivors
    assert set(pool.stats().per_store) == set(handles) - {dead}

    handles[dead].failed = False
    pool.add_store(dead, handles[dead])  # back on the ring with its old (still intact) contents
    assert pool.failed_store_ids == () and pool.match_prefix(CHAIN) == 24


def test_a_dropped_store_is_probed_and_rejoins_once_it_answers(handles: dict[StoreId, LocalStoreHandle]) -> None:
    pool = PrefixCachePool(handles, retry_s=0.2)
    pool.put([(h, blob(h)) for h in CHAIN]).wait()
    sick = pool.owner(CHAIN[0])
    handles[sick].fail()
    assert pool.match_prefix(CHAIN) == 0 and pool.failed_store_ids == (sick,)
    time.sleep(0.25)
    assert pool.match_prefix(CHAIN[:1]) == 0  # probed: still failing, so the next probe is 0.4 s away
    handles[sick].failed = False  # it answers again (a slow store, or one Ray restarted)
    pool.match_prefix([])
    assert pool.failed_store_ids == (sick,) and pool.num_rejoined == 0  # not probed again yet
    time.sleep(0.45)
    assert pool.match_prefix(CHAIN) == 24  # this call's probe got the answer before routing
    assert pool.failed_store_ids == () and sick in pool.store_ids and pool.num_rejoined == 1
    # Dropped a second time, it waits twice as long before its first probe (a flapping store).
    handles[sick].fail()
    pool.match_prefix(CHAIN)
    handles[sick].failed = False
    time.sleep(0.25)
    pool.match_prefix([])
    assert pool.failed_store_ids == (sick,)
    time.sleep(0.2)
    pool.match_prefix([])
    assert pool.failed_store_ids == () and pool.num_rejoined == 2


def test_every_store_failed_means_empty_answers(handles: dict[StoreId, LocalStoreHandle]) -> None:
    pool = PrefixCachePool(handles)
    for handle in handles.values():
        handle.fail()
    assert pool.match_prefix(CHAIN) == 0
    assert pool.store_ids == [] and len(pool.failed_store_ids) == 3
    assert pool.get_prefix(CHAIN) == [] and pool.match_prefix(CHAIN) == 0
    assert pool.put([(h, blob(h)) for h in CHAIN]).wait() == 0
    assert pool.stats().total.num_puts == 0


class _Hung:
    def result(self, timeout_s: float) -> object:
        time.sleep(timeout_s)  # a store that never answers: wait out exactly the deadline
        raise StoreTimeout(f"no answer within {timeout_s:.3f} s")


class HungHandle:
    def call(self, method: StoreMethod, *args: object) -> PendingCall:
        return _Hung()


def test_hung_stores_cost_one_shared_deadline(handles: dict[StoreId, LocalStoreHandle]) -> None:
    stores = {StoreId("s0"): handles[StoreId("s0")], StoreId("h1"): HungHandle(), StoreId("h2"): HungHandle()}
    pool = PrefixCachePool(stores, timeout_s=1.0)
    live = [h for h in CHAIN if pool.owner(h) == "s0"]
    pool.put([(h, blob(h)) for h in live])  # hangs nowhere: only s0 owns these
    first_hung = next(i for i, h in enumerate(CHAIN) if pool.owner(h) != "s0")
    start = time.monotonic()
    assert pool.match_prefix(CHAIN) == first_hung
    elapsed = time.monotonic() - start
    assert 1.0 <= elapsed < 1.8  # both hung stores shared one 1 s deadline (not 2 s; slack for a loaded box)
    assert sorted(pool.failed_store_ids) == ["h1", "h2"] and pool.store_ids == ["s0"]
    assert pool.match_prefix(live) == len(live)


def test_bad_input_raises_before_any_call(handles: dict[StoreId, LocalStoreHandle]) -> None:
    pool = PrefixCachePool(handles)
    with pytest.raises(TypeError):
        pool.put([(CHAIN[0], "not bytes")])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        pool.match_prefix([BlockHash(-1)])
    with pytest.raises(ValueError):
        PrefixCachePool(handles, timeout_s=0)
    assert all(h.store.stats().num_puts == 0 for h in handles.values())
    assert pool.failed_store_ids == ()
