"""Request-aware paging: held blocks in the pool, contiguous runs for long requests, the plain free
queue for short ones, and block hashes / prefix sharing identical under every policy. Block ids and
counts are asserted exactly."""

from __future__ import annotations

import pytest
import torch

from actors.engine.block_pool import FREE, HELD, BlockPool
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.kv_cache_manager import KVCacheManager
from actors.engine.paging import Pager, PagingPolicy
from actors.engine.request import Request
from actors.engine.sampling import SamplingParams, SamplingState

BS = 4
AWARE = PagingPolicy("request_aware", long_tokens=16, run_blocks=4)


def make_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(rid, prompt, SamplingState(params, 0, prompt), BS)


def prefill(kv: KVCacheManager, req: Request) -> None:
    computed, hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - hit, computed)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)


def decode(kv: KVCacheManager, req: Request, token: int) -> bool:
    req.append_token(token)
    if not kv.allocate_slots(req, 1):
        return False
    req.num_computed_tokens += 1
    kv.cache_computed_blocks(req)
    return True


def test_held_blocks_go_after_empty_ones_and_before_cached_ones():
    pool = BlockPool(6)
    [a] = pool.allocate(1)
    pool.cache_block(a, 7)
    pool.free([a])  # block 0 now holds a cached prefix, at the queue's back
    pool.hold([4, 5])
    assert pool.num_free_blocks == 6 and pool.num_held_blocks == 2 and pool.free_block_ids() == [1, 2, 3, 0]
    assert [pool.free_state[i] for i in (0, 4, 5)] == [2, HELD, HELD]
    got = pool.allocate(5)
    assert [b.block_id for b in got] == [1, 2, 3, 4, 5]  # the held ones before the cached prefix
    assert pool.get_cached_block(7) is a and pool.num_evictions == 0
    pool.check_integrity()
    with pytest.raises(AssertionError):
        pool.hold([0])  # a cached block is never held: holding it would hide the prefix


def test_hard_holds_are_not_free_for_others_and_unhold_returns_them():
    pool = BlockPool(4, hard_holds=True)
    pool.hold([2, 3])
    assert pool.num_free_blocks == 2 and not pool.can_allocate(3)
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    assert [b.block_id for b in pool.take([3])] == [3]  # the holder takes its own
    pool.unhold([2])
    assert pool.free_block_ids() == [2] and pool.free_state[2] == FREE
    pool.check_integrity()


def test_long_requests_get_contiguous_runs_short_ones_the_free_queue():
    kv = KVCacheManager(32, BS, paging=AWARE)
    short = make_request("s", list(range(100, 106)), 4)  # 10 tokens expected: short
    long = make_request("l", list(range(200, 206)), 20)  # 26 tokens expected: 7 blocks, long
    prefill(kv, short)
    prefill(kv, long)
    assert kv.block_ids("s") == [0, 1]  # the free queue's front
    # a run at the top of the pool: the 2 blocks it needs now and 4 held ahead
    assert kv.block_ids("l") == [26, 27] and kv.pool.num_held_blocks == 4
    other = make_request("o", list(range(300, 310)), 2)
    prefill(kv, other)
    assert kv.block_ids("o") == [2, 3, 4]  # a short request never takes the held blocks while others are free
    for t in range(13):
        assert decode(kv, long, 1000 + t)
        kv.check_integrity()
    assert kv.block_ids("l") == [26, 27, 28, 29, 30]  # 19 tokens: 5 blocks, one run
    assert kv.pool.num_held_blocks == 1 and kv.pager.stats().num_runs == 1
    kv.free(long)
    assert kv.pool.num_held_blocks == 0
    kv.check_integrity()


def test_next_run_extends_in_place_when_free_else_goes_to_the_highest_free_range():
    kv = KVCacheManager(64, BS, enable_caching=False, paging=PagingPolicy("request_aware", long_tokens=16, run_blocks=2))
    top = make_request("x", list(range(8)), 40)  # 12 blocks expected: takes 2, holds 2 ahead
    prefill(kv, top)
    req = make_request("c", list(range(8)), 40)
    prefill(kv, req)
    assert kv.block_ids("x") == [60, 61] and kv.block_ids("c") == [56, 57]  # runs never overlap a hold
    kv.free(top)
    for t in range(10):
        assert decode(kv, req, t)  # 18 tokens: 5 blocks; the second run starts right after the first
    assert kv.block_ids("c") == [56, 57, 58, 59, 60] and kv.pager.stats().num_runs == 3
    short = make_request("s", list(range(50, 58)), 1)
    prefill(kv, short)
    assert kv.block_ids("s") == [0, 63]  # the free queue's front (in id order); 61, 62 are held for "c"
    for t in range(11):
        assert decode(kv, req, t)  # 29 tokens: 8 blocks; 63 is taken: the next run is the highest free one
    assert kv.block_ids("c") == [56, 57, 58, 59, 60, 61, 62, 53]
    kv.check_integrity()


def test_runs_evict_only_the_prefixes_lazy_paging_would_evict():
    kv = KVCacheManager(10, BS, paging=AWARE)
    pool = kv.pool
    blocks = pool.allocate(10)
    for b in blocks:
        pool.cache_block(b, 1000 + b.block_id)
    for ids in ([5, 4, 3], [9, 8], [1, 0]):  # LRU: 5, 4, 3, 9, 8, 1, 0; blocks 2, 6, 7 stay in use
        pool.free(blocks[i] for i in ids)
    req = make_request("l", list(range(8)), 20)  # long; its 2 blocks: lazy would evict 5 and 4
    assert kv.allocate_slots(req, 8)
    assert kv.block_ids("l") == [4, 5] and pool.num_held_blocks == 0  # nothing empty to hold ahead
    assert sorted(pool.cached_hashes()) == [1000, 1001, 1002, 1003, 1006, 1007, 1008, 1009]
    other = make_request("m", list(range(50, 62)), 20)  # 3 blocks: 3, 9, 8 by LRU, never a range of 3
    assert kv.allocate_slots(other, 12)
    assert kv.block_ids("m") == [3, 8, 9] and kv.pager.stats().num_run_misses == 1  # lazy's, in id order
    pool.check_integrity()


def test_soft_holds_are_lent_under_pressure_and_the_owner_starts_a_new_run():
    kv = KVCacheManager(8, BS, enable_caching=False, paging=AWARE)
    long = make_request("l", list(range(4)), 28)  # 8 blocks expected
    prefill(kv, long)
    assert kv.block_ids("l") == [3] and kv.pool.num_held_blocks == 4  # run 3..7
    hog = make_request("h", list(range(50, 70)), 2)  # 22 tokens expected: long too, but only 3 free in a row
    prefill(kv, hog)  # 5 blocks: 0..2 are not enough in a row: scattered, the oldest held blocks lent
    assert kv.block_ids("h") == [0, 1, 2, 4, 5]
    assert kv.pager.stats().num_run_misses == 1
    for t in range(4):
        assert decode(kv, long, t)
    assert kv.block_ids("l") == [3, 7]  # block 4 was lent: the plan broke, the highest free block is 7
    assert kv.pager.stats().num_broken_holds == 1
    kv.check_integrity()


def test_hard_holds_count_for_their_owner_only():
    policy = PagingPolicy("request_aware", long_tokens=16, run_blocks=4, hard_holds=True)
    kv = KVCacheManager(8, BS, enable_caching=False, paging=policy)
    long = make_request("l", list(range(4)), 28)
    prefill(kv, long)
    assert kv.block_ids("l") == [3] and kv.pool.num_free_blocks == 3 and kv.pager.num_own_held("l") == 4
    other = make_request("o", list(range(20)), 1)
    computed, _ = kv.get_computed_blocks(other)
    assert not kv.allocate_slots(other, 20, computed)  # 5 blocks, 3 free for it
    for t in range(16):
        assert decode(kv, long, t)
    assert kv.block_ids("l") == [3, 4, 5, 6, 7]
    kv.check_integrity()


def test_trim_gives_the_rejected_slots_back_to_the_run():
    kv = KVCacheManager(32, BS, enable_caching=False, paging=AWARE)
    req = make_request("l", list(range(6)), 30)
    prefill(kv, req)
    assert kv.allocate_slots(req, 8)  # 6 + 8 = 14 tokens: 4 blocks (speculative slots)
    assert kv.block_ids("l") == [26, 27, 28, 29]  # run 26..31: 2 blocks for the prompt, 4 ahead
    assert kv.trim(req, 7) == 2  # blocks 28 and 29 go back, held for this request
    assert kv.pool.free_state[28] == HELD and kv.pool.free_state[29] == HELD
    assert kv.allocate_slots(req, 5)  # 11 tokens: 3 blocks
    assert kv.block_ids("l") == [26, 27, 28]
    assert kv.allocate_slots(req, 8)
    assert kv.block_ids("l") == [26, 27, 28, 29]
    kv.check_integrity()


@pytest.mark.parametrize("hard", [False, True])
def test_hashes_and_prefix_hits_do_not_depend_on_the_policy(hard):
    """The same workload under lazy and request-aware paging: every request's cached blocks carry its
    own chain of hashes, and the prefix hits are identical."""
    shared = list(range(500, 524))
    work = [(f"r{i}", shared[: 8 + 4 * (i % 5)] + [i] * (3 + i), 4 + 7 * (i % 3)) for i in range(12)]

    def run(policy: PagingPolicy) -> tuple[list[int], dict[str, list[int]]]:
        kv = KVCacheManager(48, BS, paging=policy)
        hits, live = [], []
        for rid, prompt, max_tokens in work:
            req = make_request(rid, prompt, max_tokens)
            _, hit = kv.get_computed_blocks(req)
            hits.append(hit)
            prefill(kv, req)
            for t in range(max_tokens - 1):
                assert decode(kv, req, 7 * t % 11)
            blocks = kv._blocks[rid]
            assert [b.block_hash for b in blocks[: len(req.block_hashes)] if b.block_hash is not None] == [
                h for b, h in zip(blocks, req.block_hashes) if b.block_hash is not None]
            for b, h in zip(blocks, req.block_hashes):
                assert kv.pool.get_cached_block(h) is not None
            live.append(req)
            if len(live) > 2:
                kv.free(live.pop(0))
            kv.check_integrity()
        return hits, {r.request_id: kv.block_ids(r.request_id) for r in live}

    lazy_hits, lazy_tables = run(PagingPolicy())
    aware_hits, aware_tables = run(PagingPolicy("request_aware", 16, 4, hard_holds=hard))
    assert aware_hits == lazy_hits and sum(lazy_hits) > 0
    assert aware_tables != lazy_tables  # the placement did change


def test_engine_greedy_tokens_are_the_same_with_runs(tiny_llama_dir):
    """KV placed in runs (soft holds) reads back exactly: same greedy tokens as the lazy policy."""
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(4, 500, (9 + 13 * i,), generator=g).tolist() for i in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    def run(policy: PagingPolicy) -> tuple[dict[str, list[int]], list[int]]:
        engine = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64, block_size=BS, kv_paging=policy))
        engine.kv.pager = Pager(engine.kv.pool, policy, BS)  # engine.py builds its manager with the default policy
        for i, p in enumerate(ps):
            engine.add_request(f"q{i}", p, params)
        engine.step()
        table = engine.kv.block_ids("q3")
        out: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            out.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        engine.check_integrity()
        return out, table

    lazy, lazy_table = run(PagingPolicy())
    aware, aware_table = run(PagingPolicy("request_aware", long_tokens=40, run_blocks=8))
    assert aware == lazy and len(lazy) == 4
    assert aware_table == list(range(aware_table[0], aware_table[0] + len(aware_table))) != lazy_table


def test_policy_validation():
    with pytest.raises(ValueError):
        PagingPolicy("huge_pages")
    with pytest.raises(ValueError):
        PagingPolicy("request_aware", run_blocks=0)
    with pytest.raises(ValueError):
        EngineConfig(kv_paging="request_aware")  # type: ignore[arg-type]
