"""A prefill worker's `prefetch`: while a request waits, the part of its prefix this engine lacks
comes up from the pool's disk tier, so its lookup is served from DRAM; the tokens are unchanged
and every prefetched block is read (accuracy 1). Offers carry the request's tenant."""

from __future__ import annotations

import asyncio
from pathlib import Path

from actors.engine.block_hash import BlockHash
from actors.handoff import prompt_block_hashes
from actors.messages import GenerationRequest
from actors.prefix_cache.handles import LocalStoreHandle
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore

from .harness import GREEDY, LocalCluster, random_tokens, reference, worker_config

PREFIX = random_tokens(64, seed=200)  # 4 full blocks


def test_prefetch_brings_a_waiting_requests_prefix_up_from_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    first, second = PREFIX + random_tokens(5, seed=1), PREFIX + random_tokens(6, seed=2)
    want = reference(tiny_model_dir, [first, second], GREEDY)

    async def main() -> None:
        cfg = PrefixCacheConfig(dram_bytes=1 << 20, disk_bytes=1 << 24, disk_dir=str(tmp_path))
        handles = {StoreId(f"s{i}"): LocalStoreHandle(PrefixCacheStore(cfg, f"s{i}")) for i in range(2)}
        pool = PrefixCachePool(handles, timeout_s=2.0)
        cluster = await LocalCluster.start(worker_config(tiny_model_dir), num_prefill=2, pool=pool)
        try:
            a = await cluster.run(GenerationRequest("a", first, GREEDY, tenant="acme"), 0)
            assert await cluster.prefills[0].flush_offers(10.0)
            chain = prompt_block_hashes(GenerationRequest("a", first, GREEDY, tenant="acme"), 16)[:4]
            use = pool.tenant_usage()
            assert list(use) == ["acme"] and use["acme"].dram_bytes > 0
            block_bytes = use["acme"].dram_bytes // 4
            # Other tenants' newer, busier blocks push the prefix down to disk in every store.
            for n, handle in enumerate(handles.values()):
                for i in range(cfg.dram_bytes // block_bytes + 8):  # more than its DRAM holds
                    h = BlockHash((n << 64) + i + 1)
                    handle.store.put([(h, bytes(block_bytes))], tenant="globex")
                    handle.store.get([h, h])
            assert all(handles[pool.owner(h)].store.disk_eviction_order().count(h) for h in chain)

            req = GenerationRequest("b", second, GREEDY, tenant="acme")
            await cluster.prefills[1].prefetch(req)
            assert cluster.prefills[1].pool_stats().num_prefetches == 1  # type: ignore[union-attr]
            before = pool.stats().total
            assert before.num_prefetched == 4 and all(
                h in handles[pool.owner(h)].store.dram_eviction_order() for h in chain)
            b = await cluster.run(req, 1)
            after = pool.stats().total
            assert b.result is not None and b.result.num_pool_hit_blocks == 4
            assert (after.num_hits_dram - before.num_hits_dram, after.num_hits_disk - before.num_hits_disk) == (4, 0)
            assert (after.num_prefetch_used, after.prefetch_accuracy) == (4, 1.0)
            assert [a.token_ids, b.token_ids] == want
        finally:
            cluster.close()

    asyncio.run(main())
