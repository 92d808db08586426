"""Prefix reuse by tier: the pool's counters read from fabricated `/health` answers, their
difference around a rate, and the row that joins them with the timelines' figures."""

from __future__ import annotations

from typing import Any

from bench.loadgen.prefix_tiers import DEFAULT_BLOCK_SIZE, PoolReading, block_size_of, pool_delta, tier_tokens
from bench.loadgen.report import RatePoint, SystemResult, stage_table
from bench.loadgen.stages import STAGE_COLUMNS, stage_row


def health(dram: int, disk: int, miss: int, stores: int = 2, **extra: Any) -> dict[str, Any]:
    """A ferry cluster's /health with a prefix_pool section as deploy/pool_source.py writes it."""
    return {"healthy": True, "workers": {}, "prefix_pool": {
        "dram_mib": 3.0, "disk_mib": 0.0, "hit_rate": 0.5, "dram_hit_rate": 0.4, "disk_hit_rate": 0.1,
        "prefetched_blocks": 0, "prefetch_accuracy": 0.0, "hit_blocks": {"dram": dram, "disk": disk},
        "miss_blocks": miss, "stores_answered": stores, "by_tenant": {}, **extra}}


def test_a_reading_takes_the_cumulative_counters_of_the_pool_section() -> None:
    assert PoolReading.of(health(40, 7, 9)) == PoolReading({"dram": 40, "disk": 7}, 9, 2)


def test_no_usable_pool_section_reads_as_none() -> None:
    assert PoolReading.of({"healthy": True, "workers": {}}) is None  # no stores (num_stores: 0)
    assert PoolReading.of({}) is None  # llama.cpp's /health, or none at all
    assert PoolReading.of({"prefix_pool": {"error": "TimeoutError: "}}) is None  # the pool did not answer
    old = health(1, 1, 1)
    for key in ("hit_blocks", "miss_blocks", "stores_answered"):
        del old["prefix_pool"][key]
    assert PoolReading.of(old) is None  # a server older than the per-tier counts: rates only
    half = health(1, 1, 1)
    half["prefix_pool"]["hit_blocks"] = {"dram": 3}
    assert PoolReading.of(half) is None


def test_the_delta_is_the_lookups_between_two_readings() -> None:
    before, after = PoolReading.of(health(40, 7, 9)), PoolReading.of(health(65, 10, 9))
    assert pool_delta(before, after) == {"dram": 25, "disk": 3, "miss": 0}
    assert pool_delta(before, before) == {"dram": 0, "disk": 0, "miss": 0}


def test_the_delta_is_unknown_when_the_readings_do_not_compare() -> None:
    before = PoolReading.of(health(40, 7, 9))
    assert pool_delta(None, before) is None and pool_delta(before, None) is None
    # a store that did not answer one of them: its counts are missing from that sum only
    assert pool_delta(before, PoolReading.of(health(90, 12, 11, stores=1))) is None
    # a store restarted meanwhile: its counters began again at zero
    assert pool_delta(before, PoolReading.of(health(41, 2, 12))) is None


def test_the_block_size_is_the_first_engine_that_says() -> None:
    assert block_size_of([None, {"block_size": 32, "num_blocks": 10}, {"block_size": 16}]) == 32
    assert block_size_of([None, {"source": "configured"}]) is None and block_size_of([]) is None


def test_tier_tokens_split_the_reuse_of_a_rate() -> None:
    # timelines: 640 prompt tokens reused, 24 of the blocks imported from the pool by prefill workers;
    # the stores served 25 blocks from DRAM and 3 from disk meanwhile (one more than the prefills used)
    stages = {"prefix_hit_tokens": 640, "local_hit_blocks": 16, "pool_hit_blocks": 24}
    got = tier_tokens(stages, {"dram": 25, "disk": 3, "miss": 4}, 16)
    assert got == {"block_size": 16, "local_hit_tokens": 640 - 24 * 16, "pool_hit_tokens": 384,
                   "pool_dram_tokens": 400, "pool_disk_tokens": 48,
                   "pool_lookups": {"dram": 25, "disk": 3, "miss": 4}}
    assert tier_tokens(stages, None, 8)["local_hit_tokens"] == 640 - 24 * 8  # the engines' block size counts
    # imports the engine lost before admitting the prompt (evicted meanwhile) leave no negative own-cache share
    assert tier_tokens(stages, None, 32)["local_hit_tokens"] == 0


def test_without_a_pool_the_tiers_are_unknown_not_zero() -> None:
    got = tier_tokens({"prefix_hit_tokens": 96, "pool_hit_blocks": 0}, None, None)
    assert got["block_size"] == DEFAULT_BLOCK_SIZE == 16
    assert (got["local_hit_tokens"], got["pool_hit_tokens"]) == (96, 0)
    assert got["pool_dram_tokens"] is None and got["pool_disk_tokens"] is None and got["pool_lookups"] is None


def test_the_stage_table_shows_the_tiers_and_a_dash_without_a_pool() -> None:
    names = [name for name, _ in STAGE_COLUMNS]
    cols = [names.index(n) for n in ("own-cache tok", "pool tok", "pool DRAM tok", "pool disk tok")]
    with_pool = {"num_requests": 4, "prefix_hit_tokens": 640, "pool_hit_blocks": 24}
    with_pool.update(tier_tokens(with_pool, {"dram": 25, "disk": 3, "miss": 0}, 16))
    without = {"num_requests": 4, "prefix_hit_tokens": 96, "pool_hit_blocks": 0}
    without.update(tier_tokens(without, None, 16))
    assert [stage_row(1.0, with_pool)[c] for c in cols] == [256, 384, 400, 48]
    assert [stage_row(1.0, without)[c] for c in cols] == [96, 0, None, None]
    points = [RatePoint(1.0, None, [], [], stages=s) for s in (with_pool, without)]  # type: ignore[arg-type]
    text = stage_table([SystemResult("ferry", points)])
    assert text is not None
    head, _, row_pool, row_none = text.splitlines()
    assert head.endswith("prefix hit tok  own-cache tok  pool tok  pool DRAM tok  pool disk tok")
    assert row_pool.split()[-4:] == ["256", "384", "400", "48"] and row_none.split()[-4:] == ["96", "0", "-", "-"]
