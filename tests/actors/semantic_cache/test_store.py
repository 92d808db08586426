"""SemanticStore with hand-made vectors and a fake clock: isolation, decay, pinning, capacity,
slot reuse and restart, asserted exactly (entry ids, eviction order)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from actors.semantic_cache import CachedResponse, CacheKey, InvalidSemanticCacheConfig, SemanticCacheConfig
from actors.semantic_cache.persist import load_store, save_store
from actors.semantic_cache.store import SemanticStore

DIM = 8
KEY = CacheKey("m", "tenant-a", "temperature=0")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def vec(i: int) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[i % DIM] = 1.0
    return v


def answer(i: int) -> CachedResponse:
    return CachedResponse(f"answer {i}", (i, i + 1), "stop")


def make(clock: FakeClock, **kw: object) -> SemanticStore:
    cfg = SemanticCacheConfig(**{"dim": DIM, "threshold": 0.9, "half_life_s": 100.0, "score_floor": 0.2,
                                 "max_entries": 4, **kw})  # type: ignore[arg-type]
    return SemanticStore(cfg, clock=clock)


@pytest.mark.parametrize("threshold", [-0.01, 1.01, float("nan"), "0.9"])
def test_threshold_outside_unit_interval_is_refused(threshold: object) -> None:
    with pytest.raises(InvalidSemanticCacheConfig, match="threshold must be a cosine similarity between 0 and 1"):
        SemanticCacheConfig(threshold=threshold)  # type: ignore[arg-type]


def test_other_bad_settings_are_refused() -> None:
    with pytest.raises(InvalidSemanticCacheConfig, match="half_life_s"):
        SemanticCacheConfig(half_life_s=0)
    with pytest.raises(InvalidSemanticCacheConfig, match="max_entries"):
        SemanticCacheConfig(max_entries=0)
    with pytest.raises(InvalidSemanticCacheConfig, match="score_floor"):
        SemanticCacheConfig(score_floor=1.0)


def test_hit_needs_threshold_and_same_partition() -> None:
    store = make(FakeClock())
    store.insert(KEY, vec(0), "p0", answer(0))
    hit, sim = store.lookup(KEY, vec(0))
    assert hit is not None and hit.response == answer(0) and hit.similarity == pytest.approx(1.0)
    near = vec(0) + 0.3 * vec(1)  # cosine 0.958
    assert store.lookup(KEY, near)[0] is not None
    far = vec(0) + 0.6 * vec(1)  # cosine 0.857 < 0.9
    hit, sim = store.lookup(KEY, far)
    assert hit is None and sim == pytest.approx(1 / np.sqrt(1.36), abs=1e-5)
    for other in (CacheKey("m", "tenant-b", "temperature=0"), CacheKey("m2", "tenant-a", "temperature=0"),
                  CacheKey("m", "tenant-a", "temperature=0,max_tokens=9")):
        assert store.lookup(other, vec(0)) == (None, None)
    stats = store.snapshot_stats()
    assert (stats.num_lookups, stats.num_hits, stats.size) == (6, 2, 1)
    assert sum(stats.similarity_histogram) == 3 and stats.similarity_histogram[-1] == 2  # two hits at >0.95
    store.check_integrity()


def test_decay_deletes_below_floor_and_hits_refresh() -> None:
    clock = FakeClock()
    store = make(clock)
    a = store.insert(KEY, vec(0), "a", answer(0))
    clock.now += 100
    b = store.insert(KEY, vec(1), "b", answer(1))
    clock.now += 100  # a: 0.25, b: 0.5
    assert store.lookup(KEY, vec(0))[0] is not None  # a refreshed: 0.25 + 1 = 1.25
    assert store.partitions[KEY].entries[a].score == pytest.approx(1.25)
    clock.now += 150  # a: 1.25 * 2**-1.5 = 0.442, b: 0.5 * 2**-1.5 = 0.177 < floor
    assert store.sweep() == 1
    assert list(store.partitions[KEY].entries) == [a]
    assert store.lookup(KEY, vec(1))[0] is None  # b is gone; a is too far to answer
    clock.now += 200  # a: 0.11 < floor: an expired entry never answers
    assert store.lookup(KEY, vec(0))[0] is None
    assert len(store) == 0 and store.stats.num_evicted_decay == 2
    assert b is not None
    store.check_integrity()


def test_capacity_evicts_lowest_score_then_oldest_and_spares_pinned() -> None:
    clock = FakeClock()
    store = make(clock, half_life_s=1000.0, score_floor=0.0)
    ids = []
    for i in range(4):
        ids.append(store.insert(KEY, vec(i), f"p{i}", answer(i)))
        clock.now += 10
    store.pin(KEY, ids[0])
    store.lookup(KEY, vec(1))  # 1 refreshed: highest unpinned score
    assert store.eviction_order() == [(KEY, ids[2]), (KEY, ids[3]), (KEY, ids[1])]
    other = CacheKey("m", "tenant-b", "temperature=0")
    slots_before = store.partitions[KEY].index.num_slots
    store.insert(other, vec(5), "q", answer(5))  # full: evicts 2
    assert sorted(store.partitions[KEY].entries) == [ids[0], ids[1], ids[3]]
    store.insert(KEY, vec(6), "r", answer(6))  # evicts 3; its hnswlib slot is reused
    assert sorted(store.partitions[KEY].entries) == [ids[0], ids[1], 4]
    assert store.partitions[KEY].index.num_slots == slots_before
    assert len(store) == 4 and store.stats.num_evicted_capacity == 2
    store.check_integrity()


def test_pinned_never_decay_and_full_of_pinned_refuses() -> None:
    clock = FakeClock()
    store = make(clock, max_entries=2)
    for i in range(2):
        store.pin(KEY, store.insert(KEY, vec(i), f"p{i}", answer(i)))  # type: ignore[arg-type]
    clock.now += 1e6
    assert store.sweep() == 0 and store.lookup(KEY, vec(1))[0] is not None
    assert store.insert(KEY, vec(3), "p3", answer(3)) is None
    stats = store.snapshot_stats()
    assert (stats.size, stats.num_pinned, stats.num_refused_full) == (2, 2, 1)


def test_restart_keeps_entries_scores_and_deleted_slots(tmp_path: Path) -> None:
    clock = FakeClock()
    store = make(clock)
    first = store.insert(KEY, vec(0), "a", answer(0))
    store.insert(KEY, vec(1), "b", answer(1))
    other = CacheKey("m", "tenant-b", "x")
    store.pin(other, store.insert(other, vec(2), "c", answer(2)))  # type: ignore[arg-type]
    store.partitions[KEY].index.delete(first)  # a deleted slot must survive the reload as deleted
    del store.partitions[KEY].entries[first]
    save_store(store, tmp_path)
    clock.now += 50
    again = load_store(store.cfg, tmp_path, clock=clock)
    again.check_integrity()
    assert len(again) == 2
    hit, _ = again.lookup(KEY, vec(1))
    assert hit is not None and hit.response == answer(1) and hit.prompt == "b"
    assert again.lookup(KEY, vec(0))[0] is None  # deleted before the save, deleted after
    assert again.partitions[CacheKey("m", "tenant-b", "x")].entries[0].pinned
    assert again.insert(KEY, vec(3), "d", answer(3)) == 2  # ids continue, the deleted slot is reused
    again.check_integrity()
