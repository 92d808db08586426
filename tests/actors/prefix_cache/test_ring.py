"""Consistent hashing: few keys move when stores come and go, and placement is stable."""

from __future__ import annotations

from collections import Counter

import pytest

from actors.engine.block_hash import BlockHash
from actors.prefix_cache.ring import EmptyRing, HashRing, StoreId, key_point

KEYS = [BlockHash(k) for k in range(10_000)]


def ids(n: int) -> list[StoreId]:
    return [StoreId(f"s{i}") for i in range(n)]


def test_removing_a_store_moves_only_its_own_keys() -> None:
    ring = HashRing(ids(5))
    before = {k: ring.owner(k) for k in KEYS}
    ring.remove(StoreId("s2"))
    after = {k: ring.owner(k) for k in KEYS}
    moved = [k for k in KEYS if after[k] != before[k]]
    assert moved == [k for k in KEYS if before[k] == "s2"]
    assert "s2" not in after.values()
    # The removed store's keys spread over all survivors, not onto one neighbour.
    assert set(after[k] for k in moved) == {"s0", "s1", "s3", "s4"}


def test_adding_a_store_moves_about_one_in_n_plus_one_keys_all_to_it() -> None:
    ring = HashRing(ids(4))
    before = {k: ring.owner(k) for k in KEYS}
    ring.add(StoreId("s4"))
    moved = [k for k in KEYS if ring.owner(k) != before[k]]
    assert all(ring.owner(k) == "s4" for k in moved)
    assert len(moved) == sum(1 for k in KEYS if ring.owner(k) == "s4")
    assert abs(len(moved) / len(KEYS) - 1 / 5) < 0.3 / 5  # 64 vnodes: within 30% of the ideal


@pytest.mark.parametrize("num_stores", [3, 8])
def test_every_store_gets_a_fair_share(num_stores: int) -> None:
    ring = HashRing(ids(num_stores))
    counts = Counter(ring.owner(k) for k in KEYS)
    assert set(counts) == set(ids(num_stores))
    fair = len(KEYS) / num_stores
    assert all(0.7 * fair < c < 1.3 * fair for c in counts.values()), counts


def test_placement_is_independent_of_insertion_order_and_process() -> None:
    a = HashRing(ids(3))
    b = HashRing(reversed(ids(3)))
    assert all(a.owner(k) == b.owner(k) for k in KEYS[:2000])
    # Golden values: blake2b, not Python's salted hash(), so every process (and every release
    # that keeps this format) routes a key to the same store.
    assert key_point(BlockHash(0)) == 14593309029982546664
    ring = HashRing([StoreId("a"), StoreId("b"), StoreId("c")])
    assert [ring.owner(BlockHash(k)) for k in (0, 1, 2**127, 12345)] == ["b", "b", "c", "a"]


def test_membership_errors() -> None:
    ring = HashRing()
    with pytest.raises(EmptyRing):
        ring.owner(BlockHash(1))
    ring.add(StoreId("x"))
    assert ring.owner(BlockHash(1)) == "x" and len(ring) == 1 and "x" in ring
    with pytest.raises(ValueError, match="already"):
        ring.add(StoreId("x"))
    with pytest.raises(KeyError):
        ring.remove(StoreId("y"))
    with pytest.raises(OverflowError):
        ring.owner(BlockHash(2**128))
    with pytest.raises(ValueError):
        HashRing(vnodes_per_store=0)
