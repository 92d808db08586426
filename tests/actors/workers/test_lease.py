"""A decode worker's lease: KV that is announced but never arrives is expired, its blocks freed and
its stream failed with `KVNotArrived`; shards that come after that are dropped, not written."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from actors.errors import KVNotArrived, RequestAborted
from actors.messages import GenerationRequest

from .harness import GREEDY, NUM_BLOCKS, LocalCluster, random_tokens, worker_config

LEASE_S = 0.4


def test_announced_kv_that_never_arrives_expires(tiny_model_dir: Path) -> None:
    async def main() -> None:
        cluster = await LocalCluster.start(worker_config(tiny_model_dir, lease_s=LEASE_S, transfer_timeout_s=0.2))
        try:
            decode = cluster.decode
            assert decode is not None
            engine = decode.engine.engine
            late = GenerationRequest("late", random_tokens(70, seed=1), GREEDY)
            kept = GenerationRequest("kept", random_tokens(20, seed=2), GREEDY)
            t0 = time.monotonic()
            assert await decode.announce(late)
            assert engine.kv.pool.num_free_blocks == NUM_BLOCKS - 5  # 69 tokens of KV
            with pytest.raises(KVNotArrived, match="late"):
                async for _ in decode.generate_after_kv("late"):
                    pass
            waited = time.monotonic() - t0
            assert LEASE_S <= waited < LEASE_S + 1.0
            load = await decode.load()
            assert (load.num_reserved, load.num_free_blocks, load.healthy) == (0, NUM_BLOCKS, True)
            stats = decode.receiver_stats()
            assert (stats.num_expired, stats.num_committed, stats.num_pending) == (1, 0, 0)

            # The prefill finally sends: the shards find no reservation and are dropped.
            await cluster.prefills[0].prefill(late, cluster.peer)
            # Another request is served normally meanwhile.
            run = await cluster.run(kept)
            assert len(run.token_ids) == 8
            await asyncio.sleep(0.2)
            stats = decode.receiver_stats()
            assert (stats.num_dropped_shards, stats.num_committed) == (2, 1)
            assert decode.transport.stats().staging_in_use_bytes == 0
            engine.check_integrity()
            assert engine.kv.pool.num_free_blocks == NUM_BLOCKS
        finally:
            cluster.close()

    asyncio.run(main())


def test_closing_the_decode_worker_fails_pending_streams(tiny_model_dir: Path) -> None:
    async def main() -> None:
        cluster = await LocalCluster.start(worker_config(tiny_model_dir))
        decode = cluster.decode
        assert decode is not None
        try:
            assert await decode.announce(GenerationRequest("pending", random_tokens(40, seed=3), GREEDY))
            stream = decode.generate_after_kv("pending")
            decode.receiver.close()
            with pytest.raises(RequestAborted):
                async for _ in stream:
                    pass
            assert decode.engine.engine.kv.pool.num_free_blocks == NUM_BLOCKS
        finally:
            cluster.close()

    asyncio.run(main())
