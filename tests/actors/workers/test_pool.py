"""Prefill workers sharing a prefix-cache pool (plain stores in this process): a prefix computed by
one worker is served to another from the pool, so only the new tokens are computed; tenants are
isolated unless they opt a prefix in; a failed store turns into misses, never a failed request."""

from __future__ import annotations

import asyncio
from pathlib import Path

from actors.handoff import prompt_block_hashes
from actors.messages import GenerationRequest
from actors.prefix_cache.handles import LocalStoreHandle
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore

from .harness import GREEDY, LocalCluster, Run, random_tokens, reference, worker_config

PREFIX = random_tokens(64, seed=100)  # 4 full blocks


def make_pool(tmp_path: Path) -> tuple[PrefixCachePool, dict[StoreId, LocalStoreHandle]]:
    cfg = PrefixCacheConfig(dram_bytes=1 << 20, disk_bytes=1 << 22, disk_dir=str(tmp_path))
    handles = {StoreId(f"s{i}"): LocalStoreHandle(PrefixCacheStore(cfg, f"s{i}")) for i in range(2)}
    return PrefixCachePool(handles, timeout_s=2.0), handles


async def run_and_offer(cluster: LocalCluster, req: GenerationRequest, prefill: int) -> Run:
    run = await cluster.run(req, prefill)
    # offers run in the background; local stores are not thread-safe, so let them finish first
    assert await cluster.prefills[prefill].flush_offers(10.0)
    return run


def test_second_worker_computes_only_new_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    first, second = PREFIX + random_tokens(7, seed=1), PREFIX + random_tokens(9, seed=2)
    want = reference(tiny_model_dir, [first, second], GREEDY)

    async def main() -> None:
        pool, _ = make_pool(tmp_path)
        cluster = await LocalCluster.start(worker_config(tiny_model_dir), num_prefill=2, pool=pool)
        try:
            a = await run_and_offer(cluster, GenerationRequest("a", first, GREEDY), prefill=0)
            assert a.result is not None and (a.result.num_computed_tokens, a.result.num_pool_hit_blocks) == (71, 0)
            hashes = prompt_block_hashes(GenerationRequest("a", first, GREEDY), 16)
            assert pool.match_prefix(hashes) == 4
            assert cluster.prefills[0].pool_stats().num_stored_blocks == 4  # type: ignore[union-attr]

            forwarded_before = cluster.prefills[1].engine.engine.stats().num_forwarded_tokens
            b = await run_and_offer(cluster, GenerationRequest("b", second, GREEDY), prefill=1)
            assert b.result is not None
            assert (b.result.num_local_hit_blocks, b.result.num_pool_hit_blocks) == (0, 4)
            assert b.result.num_computed_tokens == 73 - 64
            assert cluster.prefills[1].engine.engine.stats().num_forwarded_tokens - forwarded_before == 9
            assert [a.token_ids, b.token_ids] == want
            # the pool already had every full block of b: nothing new was offered
            assert cluster.prefills[1].pool_stats().num_offered_blocks == 0  # type: ignore[union-attr]
            # Only b's fetch returned blocks: worker 1 reports what a block took to fetch, worker 0
            # (its one fetch a miss) nothing yet.
            loads = [await p.load() for p in cluster.prefills]
            assert loads[0].pool_fetch_s_per_block is None
            assert loads[1].pool_fetch_s_per_block is not None and loads[1].pool_fetch_s_per_block > 0
            assert cluster.prefills[1].pool_stats().num_timed_fetches == 1  # type: ignore[union-attr]
        finally:
            cluster.close()

    asyncio.run(main())


def test_tenants_share_pool_blocks_only_when_opted_in(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompt = PREFIX + random_tokens(12, seed=3)  # 76 tokens, 4 reusable blocks
    (want,) = reference(tiny_model_dir, [prompt], GREEDY)

    async def main() -> None:
        pool, _ = make_pool(tmp_path)
        cluster = await LocalCluster.start(worker_config(tiny_model_dir), num_prefill=2, pool=pool)
        try:
            await run_and_offer(cluster, GenerationRequest("a", prompt, GREEDY, tenant="acme"), prefill=0)
            other = await run_and_offer(cluster, GenerationRequest("b", prompt, GREEDY, tenant="globex"), prefill=1)
            assert other.result is not None
            assert (other.result.num_pool_hit_blocks, other.result.num_computed_tokens) == (0, 76)
            same = await run_and_offer(cluster, GenerationRequest("a2", prompt, GREEDY, tenant="acme"), prefill=1)
            assert same.result is not None and same.result.num_pool_hit_blocks == 4

            # A 32-token system prompt opted into sharing: two new tenants share those 2 blocks only.
            await run_and_offer(cluster, GenerationRequest("c", prompt, GREEDY, tenant="initech",
                                                           num_shared_prefix_tokens=32), prefill=0)
            d = await run_and_offer(cluster, GenerationRequest("d", prompt, GREEDY, tenant="hooli",
                                                               num_shared_prefix_tokens=32), prefill=1)
            assert d.result is not None
            assert (d.result.num_pool_hit_blocks, d.result.num_computed_tokens) == (2, 76 - 32)
            assert d.token_ids == other.token_ids == same.token_ids == want
        finally:
            cluster.close()

    asyncio.run(main())


def test_failed_store_becomes_misses(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompt = PREFIX + random_tokens(5, seed=4)
    (want,) = reference(tiny_model_dir, [prompt], GREEDY)
    hashes = prompt_block_hashes(GenerationRequest("x", prompt, GREEDY), 16)

    async def main() -> None:
        pool, handles = make_pool(tmp_path)
        cluster = await LocalCluster.start(worker_config(tiny_model_dir), num_prefill=2, pool=pool)
        try:
            await run_and_offer(cluster, GenerationRequest("x", prompt, GREEDY), prefill=0)
            owners = [pool.owner(h) for h in hashes]
            victim = owners[1]
            first_lost = owners.index(victim)
            handles[victim].fail()
            run = await run_and_offer(cluster, GenerationRequest("y", prompt, GREEDY), prefill=1)
            assert run.result is not None
            assert run.result.num_pool_hit_blocks == first_lost
            assert run.result.num_computed_tokens == 69 - 16 * first_lost
            assert run.token_ids == want
            assert pool.failed_store_ids == (victim,)
        finally:
            cluster.close()

    asyncio.run(main())


def test_a_decode_worker_prefilling_for_itself_imports_the_pools_blocks(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The scheduler's local prefill: the decode worker runs the prompt whole (no handoff), and first
    takes the prefix a prefill worker left in the pool, so it computes only the new tokens."""
    first, second = PREFIX + random_tokens(7, seed=1), PREFIX + random_tokens(9, seed=2)
    want = reference(tiny_model_dir, [first, second], GREEDY)

    async def main() -> None:
        pool, _ = make_pool(tmp_path)
        cluster = await LocalCluster.start(worker_config(tiny_model_dir), num_prefill=1, pool=pool)
        # another decode worker, which never saw the prefix: only the pool has it
        other = await LocalCluster.start(worker_config(tiny_model_dir), num_prefill=0, pool=pool, decode_pool=True)
        try:
            a = await run_and_offer(cluster, GenerationRequest("a", first, GREEDY), prefill=0)
            decode = other.decode
            assert decode is not None
            forwarded_before = decode.engine.engine.stats().num_forwarded_tokens
            b = [e async for e in decode.generate(GenerationRequest("b", second, GREEDY))]
            # 9 new prompt tokens, then one per decode step after the first output token
            assert decode.engine.engine.stats().num_forwarded_tokens - forwarded_before == 9 + GREEDY.max_tokens - 1
            assert decode.pool_stats().num_fetched_blocks == 4  # type: ignore[union-attr]
            fetch_s = (await decode.load()).pool_fetch_s_per_block  # what the scheduler prices its pool hits with
            assert fetch_s is not None and fetch_s == decode.pool_stats().fetch_s_per_block > 0  # type: ignore[union-attr]
            assert [a.token_ids, Run(None, b).token_ids] == want
        finally:
            cluster.close()
            other.close()

    asyncio.run(main())
