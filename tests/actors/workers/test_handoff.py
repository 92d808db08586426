"""Prefill -> decode handoff between two engines in one process (in-process transport): the decode
worker's stream equals a single engine's output, token for token and in text, and both engines end
with every block free."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from actors.engine.sampling import SamplingParams
from actors.errors import HandoffFailed, RequestAborted
from actors.handoff import num_handoff_blocks, transfer_tag, zero_stale_tail
from actors.messages import GenerationRequest
from transfer.codec import encode
from transfer.config import make_transport

from .harness import GREEDY, LOSSY, NUM_BLOCKS, LocalCluster, random_tokens, reference, worker_config

SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, top_k=40, seed=11, ignore_eos=True)


def test_concurrent_handoffs_match_single_engine(tiny_model_dir: Path) -> None:
    # lengths around block edges: 17 and 33 hand over exactly 1 and 2 blocks (the last token stays)
    prompts = [random_tokens(n, seed=n) for n in (2, 16, 17, 33, 40, 63)]
    want_greedy = reference(tiny_model_dir, prompts, GREEDY)
    want_sampled = reference(tiny_model_dir, prompts, SAMPLED)

    async def main() -> None:
        cluster = await LocalCluster.start(worker_config(tiny_model_dir))
        try:
            reqs = [GenerationRequest(f"g{i}", p, GREEDY) for i, p in enumerate(prompts)]
            reqs += [GenerationRequest(f"s{i}", p, SAMPLED) for i, p in enumerate(prompts)]
            runs = await asyncio.gather(*(cluster.run(r) for r in reqs))
            assert [r.token_ids for r in runs] == want_greedy + want_sampled
            for req, run in zip(reqs, runs):
                assert run.text == run.events[-1].output.text and run.events[-1].output.finished
                # One event per step, unless the consumer fell a step behind (a loaded machine): the
                # stream then merges the queued outputs into one event, never drops or repeats one.
                sizes = [len(e.output.new_token_ids) for e in run.events]
                assert sum(sizes) == 8 and min(sizes) >= 1, sizes
                times = [e.emitted_at for e in run.events]
                assert times == sorted(times)
                assert run.result is not None
                assert run.result.num_kv_blocks == num_handoff_blocks(req.num_prompt_tokens, 16)
            await asyncio.sleep(0)  # let the engines' last frees land
            assert cluster.decode is not None
            assert cluster.decode.receiver_stats().num_committed == 12
            for engine in cluster.engines():
                engine.check_integrity()
                assert engine.kv.pool.num_free_blocks == NUM_BLOCKS
        finally:
            cluster.close()

    asyncio.run(main())


def test_int8_on_the_wire_sends_the_codecs_exact_size(tiny_model_dir: Path) -> None:
    prompt = random_tokens(50, seed=3)

    async def main() -> None:
        cluster = await LocalCluster.start(worker_config(tiny_model_dir, compression="int8", num_shards=2, default_tenant_kv=LOSSY))
        try:
            run = await cluster.run(GenerationRequest("q", prompt, GREEDY))
            assert run.result is not None and len(run.token_ids) == 8
            layout = cluster.prefills[0].layout
            kv = torch.zeros(2, 2, 4, 16, 2, 16)  # 49 tokens of KV = 4 blocks, fp32
            assert run.result.kv_raw_bytes == kv.numel() * 4
            assert run.result.kv_wire_bytes == sum(len(s) for s in encode(kv, layout, compression="int8", num_shards=2))
            assert run.result.kv_wire_bytes < run.result.kv_raw_bytes / 2
        finally:
            cluster.close()

    asyncio.run(main())


def test_one_token_prompt_and_resume_run_on_the_decode_worker(tiny_model_dir: Path) -> None:
    prompt = random_tokens(30, seed=9)
    want_one, want_full = reference(tiny_model_dir, [[7], prompt], SAMPLED)

    async def main() -> None:
        cluster = await LocalCluster.start(worker_config(tiny_model_dir))
        try:
            one = GenerationRequest("one", [7], SAMPLED)
            assert not one.needs_handoff
            assert (await cluster.run(one)).token_ids == want_one
            resumed = GenerationRequest("resumed", prompt, SAMPLED, output_token_ids=want_full[:3])
            assert (await cluster.run(resumed)).token_ids == want_full[3:]
        finally:
            cluster.close()

    asyncio.run(main())


def test_corrupt_shard_fails_the_stream_and_frees_blocks(tiny_model_dir: Path) -> None:
    async def main() -> None:
        cfg = worker_config(tiny_model_dir)
        cluster = await LocalCluster.start(cfg)
        sender = make_transport(f"rogue-{id(cluster)}", cfg.transfer)
        try:
            assert cluster.decode is not None
            req = GenerationRequest("bad", random_tokens(40, seed=4), GREEDY)
            assert await cluster.decode.announce(req)
            assert cluster.decode.engine.engine.kv.pool.num_free_blocks == NUM_BLOCKS - 3
            (shard,) = encode(torch.ones(2, 2, 3, 16, 2, 16), cluster.prefills[0].layout,
                              transfer_id=transfer_tag("bad"))
            shard[-1] ^= 0xFF  # a flipped payload bit: the checksum catches it
            peer = sender.add_peer(cluster.decode.transport_metadata())
            sender.send(peer, [shard], tag=transfer_tag("bad"), timeout_s=5)
            with pytest.raises(HandoffFailed, match="checksum|crc"):
                async for _ in cluster.decode.generate_after_kv("bad"):
                    pass
            assert cluster.decode.engine.engine.kv.pool.num_free_blocks == NUM_BLOCKS
            assert cluster.decode.receiver_stats().num_failed == 1
        finally:
            sender.close()
            cluster.close()

    asyncio.run(main())


def test_abort_before_the_kv_lands_frees_blocks(tiny_model_dir: Path) -> None:
    async def main() -> None:
        cluster = await LocalCluster.start(worker_config(tiny_model_dir))
        try:
            decode = cluster.decode
            assert decode is not None
            req = GenerationRequest("gone", random_tokens(40, seed=5), GREEDY)
            assert await decode.announce(req)
            assert (await decode.load()).num_reserved == 1
            assert await decode.abort("gone")
            with pytest.raises(RequestAborted):
                async for _ in decode.generate_after_kv("gone"):
                    pass
            load = await decode.load()
            assert (load.num_reserved, load.num_free_blocks) == (0, NUM_BLOCKS)
            # the prefill still runs and sends; the late shards are dropped, its blocks released
            await cluster.prefills[0].prefill(req, cluster.peer)
            await asyncio.sleep(0.3)
            assert decode.receiver_stats().num_dropped_shards == 2
            assert decode.transport.stats().staging_in_use_bytes == 0
            assert cluster.prefills[0].engine.engine.kv.pool.num_free_blocks == NUM_BLOCKS
        finally:
            cluster.close()

    asyncio.run(main())


def test_kv_landing_after_an_engine_side_abort_touches_no_reused_block(tiny_model_dir: Path) -> None:
    stale_prompt, fresh_prompt = random_tokens(40, seed=6), random_tokens(40, seed=7)
    (want,) = reference(tiny_model_dir, [fresh_prompt], GREEDY)

    async def main() -> None:
        cluster = await LocalCluster.start(worker_config(tiny_model_dir))
        try:
            decode = cluster.decode
            assert decode is not None
            stale = GenerationRequest("stale", stale_prompt, GREEDY)
            assert await decode.announce(stale)
            stale_blocks = decode.engine.engine.kv.block_ids("stale")
            decode.engine.abort("stale")  # what a stream consumer that went away does
            fresh = GenerationRequest("fresh", fresh_prompt, GREEDY)
            assert await decode.announce(fresh)
            assert decode.engine.engine.kv.block_ids("fresh") == stale_blocks  # the freed blocks, reused
            await cluster.prefills[0].prefill(stale, cluster.peer)  # lands on a reservation that is gone
            await asyncio.sleep(0.3)
            await cluster.prefills[0].prefill(fresh, cluster.peer)
            run = [e async for e in decode.generate_after_kv("fresh")]
            assert [t for e in run for t in e.output.new_token_ids] == want
            stats = decode.receiver_stats()
            assert (stats.num_failed, stats.num_committed, stats.num_pending) == (1, 1, 0)
            decode.engine.engine.check_integrity()
            assert decode.engine.engine.kv.pool.num_free_blocks == NUM_BLOCKS
        finally:
            cluster.close()

    asyncio.run(main())


@pytest.mark.parametrize("num_prompt_tokens", [2, 16, 17, 30, 32, 33])
def test_zero_stale_tail_clears_only_slots_past_the_prompt(num_prompt_tokens: int) -> None:
    bs = 16
    n = num_handoff_blocks(num_prompt_tokens, bs)
    kv = torch.randn(2, 2, n, bs, 3, 8) + 10.0  # no zero anywhere before
    before = kv.clone()
    zero_stale_tail(kv, num_prompt_tokens, bs)
    positions = torch.arange(n * bs).view(n, bs)
    past_prompt = positions >= num_prompt_tokens
    assert torch.equal(kv[:, :, past_prompt], torch.zeros_like(kv[:, :, past_prompt]))
    assert torch.equal(kv[:, :, ~past_prompt], before[:, :, ~past_prompt])  # every prompt token kept
