"""Value-ranked tiers: eviction by expected value, admission, chain depth, prefetch and its accuracy.
(Tenant shares: test_shares.py. Plain LRU order: test_store.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.engine.block_hash import BlockHash
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore

H = BlockHash
SIZE = 40


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(SIZE))


def make(tmp_path: Path, dram_blocks: int, disk_blocks: int = 0, **kw: object) -> PrefixCacheStore:
    cfg = PrefixCacheConfig(dram_bytes=dram_blocks * SIZE, disk_bytes=max(1, disk_blocks) * SIZE,
                            enable_disk=disk_blocks > 0, disk_dir=str(tmp_path), **kw)  # type: ignore[arg-type]
    return PrefixCacheStore(cfg, f"s-{cfg.eviction}")


def put(store: PrefixCacheStore, i: int, depth: int = 0, **kw: object) -> int:
    n = store.put([(H(i), payload(i))], depths=[depth], **kw)  # type: ignore[arg-type]
    store.check_integrity()
    return n


@pytest.mark.parametrize("eviction", ["value", "lru"])
def test_a_hot_shallow_block_outlives_a_flood_of_one_off_deep_blocks_that_lru_lets_evict_it(
        tmp_path: Path, eviction: str) -> None:
    store = make(tmp_path, dram_blocks=4, eviction=eviction)
    put(store, 1)
    for _ in range(3):
        assert store.get([H(1)]) == [payload(1)]
    for i in range(100, 108):  # 8 one-off blocks deep in their chains: twice DRAM's size
        put(store, i, depth=10)
    if eviction == "lru":
        assert not store.contains(H(1))
        assert store.dram_eviction_order() == [104, 105, 106, 107]
    else:
        assert store.dram_eviction_order() == [105, 106, 107, 1]  # the hot block is worth most
        s = store.stats()
        assert (s.num_dram_evictions, s.num_dram_refused, s.num_put_refused) == (5, 0, 0)
        for i in range(108, 112):  # uses decay: with no new hit, a longer flood gets it out
            put(store, i, depth=10)
        assert not store.contains(H(1))
    store.close()


def test_a_chains_tail_leaves_dram_before_its_head(tmp_path: Path) -> None:
    store = make(tmp_path, dram_blocks=4, disk_blocks=8)
    assert store.put([(H(i), payload(i)) for i in range(6)]) == 6  # depths 0..5, one call
    store.check_integrity()
    # Every longer prefix needs the head, and a tail without its head is useless.
    assert store.dram_eviction_order() == [3, 2, 1, 0]
    assert store.disk_eviction_order() == [5, 4]
    s = store.stats()
    assert (s.num_dram_refused, s.bytes_put_dram, s.bytes_put_disk, s.num_dram_evictions) == (2, 160, 80, 0)
    store.close()


def test_admission_sends_a_block_worth_less_than_all_of_dram_to_disk_and_refuses_it_when_disk_is_better(
        tmp_path: Path) -> None:
    store = make(tmp_path, dram_blocks=2, disk_blocks=2)
    for i in range(4):
        put(store, i)
    store.get([H(0), H(1), H(2), H(3)])
    store.get([H(2), H(3)])  # 2 and 3 hit twice: DRAM holds them; 0 and 1 on disk
    assert store.dram_eviction_order() == [2, 3] and store.disk_eviction_order() == [0, 1]
    before = store.stats()
    assert put(store, 50, depth=60, shadow=True) == 0  # a deep KV shadow: worth less than everything held
    s = store.stats()
    assert not store.contains(H(50)) and store.dram_eviction_order() == [2, 3]
    assert (s.num_dram_refused - before.num_dram_refused, s.num_disk_refused - before.num_disk_refused,
            s.num_put_refused) == (1, 1, 1)
    assert put(store, 51, depth=60) == 1  # deep, but fresh and no shadow: beats the cold disk blocks
    assert store.disk_eviction_order() == [1, 51] and store.dram_eviction_order() == [2, 3]
    assert store.stats().bytes_put_disk == SIZE and store.stats().num_disk_evictions == 1
    store.close()


def test_prefetch_promotes_the_leading_disk_run_and_counts_what_is_read(tmp_path: Path) -> None:
    store = make(tmp_path, dram_blocks=3, disk_blocks=8)
    chain = [H(i) for i in range(1, 7)]
    store.put([(h, payload(h)) for h in chain])  # DRAM 1-3, disk 4-6
    store.check_integrity()
    assert store.disk_eviction_order() == [6, 5, 4]
    for i in (20, 21, 22):  # newer blocks push the whole chain to disk
        put(store, i)
    assert sorted(store.disk_eviction_order()) == [1, 2, 3, 4, 5, 6]
    assert store.remove([H(5)]) == 1  # a hole: a prefetch stops there
    assert store.prefetch([*chain, H(99)]) == 3  # 1, 2, 3 move up; 4 is refused (DRAM is full of them)
    store.check_integrity()
    assert sorted(store.dram_eviction_order()) == [1, 2, 3] and 4 in store.disk_eviction_order()
    s = store.stats()
    assert (s.num_prefetched, s.num_prefetch_used, s.num_prefetch_wasted, s.bytes_promoted) == (3, 0, 0, 3 * SIZE)
    assert store.get_prefix(chain[:2]) == [payload(1), payload(2)]
    s = store.stats()
    assert (s.num_hits_dram, s.num_prefetch_used, s.num_prefetch_wasted) == (2, 2, 0)
    assert store.prefetch(chain[:3]) == 0  # already up: nothing moves, nothing counted twice
    for i in range(30, 36):  # a flood: 3 leaves DRAM unread
        put(store, i)
        store.get([H(i)] * 3)
    store.check_integrity()
    s = store.stats()
    assert not any(h in store.dram_eviction_order() for h in chain)
    assert (s.num_prefetched, s.num_prefetch_used, s.num_prefetch_wasted) == (3, 2, 1)
    assert s.prefetch_accuracy == pytest.approx(2 / 3)
    assert store.get([H(4), H(5)]) == [payload(4), None]
    s = store.stats()
    assert (s.num_hits_dram, s.num_hits_disk, s.num_misses) == (20, 1, 1)
    assert (s.dram_hit_rate, s.disk_hit_rate) == (20 / 22, 1 / 2)
    store.close()


def test_prefetch_of_a_corrupt_file_stops_and_drops_it(tmp_path: Path) -> None:
    store = make(tmp_path, dram_blocks=1, disk_blocks=4, eviction="lru")
    store.put([(H(i), payload(i)) for i in (1, 2, 3)])  # 1 and 2 on disk, 3 in DRAM
    path = store.disk_path(H(1))
    assert path is not None
    path.write_bytes(path.read_bytes()[:-1])
    assert store.prefetch([H(1), H(2)]) == 0
    store.check_integrity()
    assert not store.contains(H(1)) and store.contains(H(2)) and store.stats().num_corrupt == 1
    store.close()


def test_bad_value_config() -> None:
    for bad in ({"eviction": "lfu"}, {"half_life_bytes": 0}, {"depth_scale_blocks": 0}, {"shadow_weight": 0.0}):
        with pytest.raises(ValueError):
            PrefixCacheConfig(**bad)  # type: ignore[arg-type]
    store = PrefixCacheStore(PrefixCacheConfig(enable_disk=False))
    with pytest.raises(ValueError):
        store.put([(H(1), b"x")], tenant="")
    with pytest.raises(ValueError):
        store.put([(H(1), b"x"), (H(2), b"y")], depths=[0])
    with pytest.raises(ValueError):
        store.put([(H(1), b"x")], depths=[-1])
    assert not store.contains(H(1))


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_of_three_tenants_keeps_every_invariant(tmp_path: Path, seed: int) -> None:
    """Puts, reads, prefetches and removes of chains by tenants with shares, in both modes: after
    every call the tiers, their value heaps, byte counts per tenant and files agree, no tier is
    over its bound and no tenant over its maximum."""
    import random

    from actors.engine.shares import TenantShare, TenantShares

    rng = random.Random(seed)
    shares = TenantShares.of_mapping({"a": TenantShare(guaranteed=0.4), "b": TenantShare(max=0.3)})
    store = make(tmp_path, dram_blocks=6, disk_blocks=10, eviction=("value", "lru")[seed % 2], tenant_shares=shares)
    chains = {t: [[H(1000 * k + 100 * c + d) for d in range(5)] for c in range(4)] for k, t in enumerate("abc", 1)}
    for _ in range(300):
        tenant = rng.choice("abc")
        chain = rng.choice(chains[tenant])
        op = rng.random()
        if op < 0.4:
            start = rng.randrange(len(chain))
            store.put([(h, payload(h)) for h in chain[start:]], tenant=tenant, depths=range(start, len(chain)),
                      shadow=rng.random() < 0.2)
        elif op < 0.7:
            got = store.get_prefix(chain)
            assert got == [payload(h) for h in chain[: len(got)]]
        elif op < 0.9:
            store.prefetch(chain)
        else:
            store.remove(rng.sample(chain, 2))
        store.check_integrity()
        for t, use in store.tenant_usage().items():
            if t == "b":
                assert use["dram_bytes"] <= 0.3 * 6 * SIZE and use["disk_bytes"] <= 0.3 * 10 * SIZE
    s = store.stats()
    assert s.num_prefetch_used + s.num_prefetch_wasted <= s.num_prefetched
    assert s.num_dram_evictions and s.num_disk_evictions and s.num_dram_evictions_share + s.num_dram_evictions_own
    store.close()
