"""One store in "lru" mode (the baseline): exact order across DRAM and disk, promotion, bounds,
corruption, stats. Value order, admission, shares and prefetch: test_value.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from actors.engine.block_hash import BlockHash
from actors.prefix_cache.stats import PrefixCacheStats
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore
from actors.prefix_cache.tiers import HEADER_BYTES, CacheDirInUse

H = BlockHash


def payload(i: int, size: int = 40) -> bytes:
    return bytes((i * 31 + j) % 256 for j in range(size))


def check(store: PrefixCacheStore) -> None:
    """Run after every operation: invariants hold and both bounds are respected."""
    store.check_integrity()
    s = store.stats()
    assert s.dram_bytes <= store.cfg.dram_bytes and s.disk_bytes <= store.cfg.disk_bytes


@pytest.fixture
def store(tmp_path: Path) -> PrefixCacheStore:
    # DRAM holds 2 blocks of 40 bytes, disk holds 3.
    s = PrefixCacheStore(PrefixCacheConfig(dram_bytes=100, disk_bytes=120, disk_dir=str(tmp_path), eviction="lru"), "s0")
    yield s
    s.close()


def test_lru_order_spill_promotion_and_exact_stats(store: PrefixCacheStore) -> None:
    assert store.put([(H(1), payload(1)), (H(2), payload(2))]) == 2
    check(store)
    assert store.put([(H(3), payload(3))]) == 1  # DRAM full: 1 spills
    check(store)
    assert (store.dram_eviction_order(), store.disk_eviction_order()) == ([2, 3], [1])
    assert store.get([H(2)]) == [payload(2)]  # 2 becomes most recent
    assert store.dram_eviction_order() == [3, 2]
    store.put([(H(4), payload(4))])
    check(store)
    store.put([(H(5), payload(5))])
    check(store)
    assert (store.dram_eviction_order(), store.disk_eviction_order()) == ([4, 5], [1, 3, 2])
    store.put([(H(6), payload(6))])  # 4 spills, and the disk deletes its oldest: 1
    check(store)
    assert (store.dram_eviction_order(), store.disk_eviction_order()) == ([5, 6], [3, 2, 4])
    assert not store.disk_path(H(1)).exists() and store.disk_path(H(3)).exists()

    assert store.get([H(3)]) == [payload(3)]  # disk hit: promoted, 5 spills to make room
    check(store)
    assert (store.dram_eviction_order(), store.disk_eviction_order()) == ([6, 3], [2, 4, 5])
    assert not store.disk_path(H(3)).exists()
    assert store.get([H(1)]) == [None]

    assert store.put([(H(2), payload(2)), (H(6), payload(6))]) == 0  # present: only touched
    check(store)
    assert (store.dram_eviction_order(), store.disk_eviction_order()) == ([3, 6], [4, 5, 2])

    assert store.match_prefix([H(6), H(3), H(4), H(1), H(5)]) == 3
    assert store.contains(H(5)) and not store.contains(H(1))
    assert (store.dram_eviction_order(), store.disk_eviction_order()) == ([3, 6], [4, 5, 2])  # queries touch nothing

    assert store.stats() == PrefixCacheStats(
        num_puts=6, num_hits_dram=1, num_hits_disk=1, num_misses=1,
        num_dram_evictions=5, num_disk_evictions=1,
        bytes_put_dram=240, bytes_spilled=200, bytes_promoted=40, bytes_served_dram=40, bytes_served_disk=40,
        num_dram_blocks=2, num_disk_blocks=3, dram_bytes=80, disk_bytes=120,
    )  # fmt: skip
    assert PrefixCacheStats.from_dict(store.stats_dict()) == store.stats()


def test_round_trip_through_disk_is_bit_identical(store: PrefixCacheStore) -> None:
    rng = random.Random(0)
    blobs = {H(2**128 - 1 - i): rng.randbytes(48) for i in range(3)}  # the largest hashes too
    blobs[H(0)] = bytes(range(256))[:50]
    for h, blob in blobs.items():  # each put pushes the previous blocks down a tier
        store.put([(h, blob)])
        check(store)
    first = next(iter(blobs))
    assert first in store.disk_eviction_order()
    assert store.disk_path(first).read_bytes()[HEADER_BYTES:] == blobs[first]
    [got] = store.get([first])
    check(store)
    assert got == blobs[first] and type(got) is bytes
    assert first in store.dram_eviction_order() and store.stats().num_hits_disk == 1
    assert store.get(list(blobs)) == list(blobs.values())  # every block, whichever tier it is in
    check(store)


def corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage",
    [
        corrupt_flip,
        lambda p: p.write_bytes(p.read_bytes()[: HEADER_BYTES // 2]),  # torn in the header
        lambda p: p.write_bytes(p.read_bytes()[:-1]),  # torn in the payload
        lambda p: p.write_bytes(b"X" + p.read_bytes()[1:]),  # bad magic
        lambda p: p.unlink(),  # vanished
        lambda p: p.write_bytes(p.with_name(f"{7:032x}.blk").read_bytes()),  # another block's file
    ],
    ids=["bitflip", "torn-header", "torn-payload", "magic", "missing", "wrong-key"],
)
def test_damaged_disk_file_is_a_miss_and_deleted(store: PrefixCacheStore, damage) -> None:
    store.put([(H(5), payload(5)), (H(7), payload(7)), (H(8), payload(8)), (H(9), payload(9))])
    assert store.disk_eviction_order() == [5, 7]
    damage(store.disk_path(H(5)))
    assert store.match_prefix([H(5)]) == 1  # the index does not read files
    assert store.get([H(5)]) == [None]
    check(store)
    assert not store.disk_path(H(5)).exists() and not store.contains(H(5))
    s = store.stats()
    assert (s.num_corrupt, s.num_misses, s.num_hits_disk, s.num_disk_blocks) == (1, 1, 0, 1)
    assert store.get([H(7)]) == [payload(7)]  # its neighbour is unharmed


def test_oversized_block_is_refused_and_exact_fit_accepted(store: PrefixCacheStore) -> None:
    store.put([(H(1), payload(1)), (H(4), payload(4))])
    assert store.put([(H(2), payload(2, 101))]) == 0
    check(store)
    assert not store.contains(H(2)) and store.stats().num_put_refused == 1
    assert store.put([(H(3), payload(3, 100))]) == 1  # fills DRAM alone: 1 then 4 spill, in LRU order
    check(store)
    assert (store.dram_eviction_order(), store.disk_eviction_order()) == ([3], [1, 4])


def test_block_too_big_for_disk_is_dropped_on_spill(tmp_path: Path) -> None:
    store = PrefixCacheStore(PrefixCacheConfig(dram_bytes=100, disk_bytes=50, disk_dir=str(tmp_path), eviction="lru"), "s")
    store.put([(H(1), payload(1, 60)), (H(2), payload(2, 40)), (H(3), payload(3, 40))])
    check(store)
    assert (store.dram_eviction_order(), store.disk_eviction_order()) == ([2, 3], [])
    assert store.stats().num_dram_evictions == 1 and not store.contains(H(1))
    store.close()


def test_without_disk_tier_eviction_drops(tmp_path: Path) -> None:
    store = PrefixCacheStore(PrefixCacheConfig(dram_bytes=80, enable_disk=False, disk_dir=str(tmp_path), eviction="lru"))
    store.put([(H(i), payload(i)) for i in range(4)])
    check(store)
    assert store.dram_eviction_order() == [2, 3] and store.disk_eviction_order() == []
    assert store.get([H(0), H(3)]) == [None, payload(3)]
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere
    assert store.stats().num_dram_evictions == 2


def test_get_prefix_stops_at_first_miss_and_remove_clear(store: PrefixCacheStore) -> None:
    store.put([(H(i), payload(i)) for i in range(1, 5)])  # DRAM [3, 4], disk [1, 2]
    assert store.get_prefix([H(3), H(9), H(4)]) == [payload(3)]
    assert store.dram_eviction_order() == [4, 3]  # 4 (after the miss) was not touched
    assert store.stats().num_misses == 1
    assert store.remove([H(4), H(1), H(9)]) == 2
    check(store)
    assert (store.dram_eviction_order(), store.disk_eviction_order()) == ([3], [2])
    assert not store.disk_path(H(1)).exists()
    store.clear()
    check(store)
    assert store.stats().num_dram_blocks == store.stats().num_disk_blocks == 0
    assert not list(store.disk_path(H(2)).parent.glob("*.blk"))


def test_disk_write_failure_loses_the_block_not_the_store(
    store: PrefixCacheStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("actors.prefix_cache.tiers.os.replace", full_disk)
    store.put([(H(i), payload(i)) for i in range(3)])
    check(store)  # also proves the temp file was removed
    assert (store.dram_eviction_order(), store.disk_eviction_order()) == ([1, 2], [])
    assert store.stats().num_disk_write_errors == 1


def test_start_removes_stale_files_and_locks_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "s0"
    folder.mkdir()
    for name in (f"{1:032x}.blk", f"{2:032x}.tmp", "notes.txt"):
        (folder / name).write_bytes(b"old")
    cfg = PrefixCacheConfig(dram_bytes=100, disk_bytes=100, disk_dir=str(tmp_path))
    store = PrefixCacheStore(cfg, "s0")
    assert sorted(p.name for p in folder.iterdir()) == [".lock", "notes.txt"]  # only our kinds go
    assert not store.contains(H(1))
    check(store)
    with pytest.raises(CacheDirInUse):
        PrefixCacheStore(cfg, "s0")  # a live store owns the folder: no one may wipe it
    PrefixCacheStore(cfg, "s1").close()  # other ids are other folders
    store.put([(H(i), payload(i)) for i in range(3)])
    store.close()
    assert not list(folder.glob("*.blk"))
    PrefixCacheStore(cfg, "s0").close()  # released


def test_bad_input_and_config() -> None:
    store = PrefixCacheStore(PrefixCacheConfig(dram_bytes=100, enable_disk=False))
    with pytest.raises(ValueError):
        store.put([(H(-1), b"x")])
    with pytest.raises(ValueError):
        store.get([H(2**128)])
    with pytest.raises(TypeError):
        store.put([(H(1), "text")])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        PrefixCacheStore(PrefixCacheConfig(enable_disk=False), "../escape")
    with pytest.raises(ValueError):
        PrefixCacheConfig(dram_bytes=0)
    with pytest.raises(ValueError):
        PrefixCacheConfig(disk_bytes=0)
    assert PrefixCacheConfig(disk_bytes=0, enable_disk=False).disk_bytes == 0


def test_default_folder_is_under_ferry_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_HOME", str(tmp_path))
    store = PrefixCacheStore(PrefixCacheConfig(dram_bytes=40, disk_bytes=100, eviction="lru"), "s9")
    store.put([(H(1), payload(1)), (H(2), payload(2))])
    assert store.disk_path(H(1)) == tmp_path / "prefix_cache" / "s9" / f"{1:032x}.blk"
    assert store.disk_path(H(1)).exists()
    store.close()
