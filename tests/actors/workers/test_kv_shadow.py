"""KV shadows: a decode worker copies a request's KV blocks to the prefix-cache pool as they fill;
a stream cut off mid-way resumes on another decode worker from those blocks, computing only the
tail, and continues with exactly the tokens of an uninterrupted run, in bfloat16 too (where a
recompute takes another path). A shadow block that is corrupt, truncated or stale is never decoded
from: the resume recomputes from that block on."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from actors.engine.config import EngineConfig
from actors.engine.sampling import SamplingParams
from actors.kv_shadow import partial_hash, resume_hashes, shadow_keys
from actors.messages import GenerationRequest
from actors.prefix_cache.pool import PrefixCachePool

from .harness import NUM_BLOCKS, LocalCluster, random_tokens, streamed_ids, worker_config
from .test_pool import make_pool

GREEDY_LONG = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=48, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
CUT = 20  # tokens streamed before the worker is lost: prompt 53 + 20 = 4 full blocks + 8 of 9 tokens shadowed


async def _cut_run(cluster: LocalCluster, req: GenerationRequest, cut: int) -> list[int]:
    """Streams `req` until `cut` tokens arrived, then drops the stream (the worker is 'lost')."""
    decode = cluster.decode
    assert decode is not None
    assert await decode.announce(req)
    await cluster.prefills[0].prefill(req, cluster.peer)
    got: list[int] = []
    stream = decode.generate_after_kv(req.request_id)
    async for event in stream:
        got += event.output.new_token_ids
        if len(got) >= cut:
            break
    await stream.aclose()
    await asyncio.sleep(0.2)  # a step or two: the blocks that filled meanwhile are queued too
    assert decode.pool is not None and await asyncio.to_thread(decode.pool.flush, 10.0)
    return got


async def _resume(worker: LocalCluster, req: GenerationRequest, done: list[int]) -> tuple[list[int], int]:
    """(tokens the resume streams, tokens its engine ran through the model)."""
    decode = worker.decode
    assert decode is not None
    before = decode.engine.engine.stats().num_forwarded_tokens
    resumed = replace(req, request_id=f"{req.request_id}~r1", output_token_ids=tuple(done))
    events = [e async for e in decode.generate(resumed)]
    return streamed_ids(events), decode.engine.engine.stats().num_forwarded_tokens - before


def _cfg(model: Path, dtype: str):  # type: ignore[no-untyped-def]
    return worker_config(model, engine=EngineConfig(num_blocks=NUM_BLOCKS, dtype=dtype))


@pytest.mark.parametrize("params", [GREEDY_LONG, SEEDED], ids=["greedy", "seeded"])
def test_resume_from_shadows_is_token_identical_in_bfloat16(tiny_model_dir: Path, tmp_path: Path,
                                                            params: SamplingParams) -> None:
    prompt = random_tokens(53, seed=11)
    req = GenerationRequest("s", prompt, params, shadow_salt="c0ffee")

    async def main() -> None:
        pool, _ = make_pool(tmp_path)
        cfg = _cfg(tiny_model_dir, "bfloat16")
        first = await LocalCluster.start(cfg, num_prefill=1, pool=pool, decode_pool=True)
        spare = await LocalCluster.start(cfg, num_prefill=0, pool=pool, decode_pool=True)
        try:
            assert await first.decode.announce(replace(req, request_id="whole"))  # type: ignore[union-attr]
            await first.prefills[0].prefill(replace(req, request_id="whole"), first.peer)
            want = streamed_ids([e async for e in first.decode.generate_after_kv("whole")])  # type: ignore[union-attr]
            done = await _cut_run(first, req, CUT)
            assert done == want[: len(done)]
            shadows = first.decode.shadow_stats()  # type: ignore[union-attr]
            assert shadows is not None and shadows.num_shadowed_blocks >= 4

            rest, forwarded = await _resume(spare, req, done)
            assert done + rest == want
            # 4 full blocks and the partly filled 5th (its first 8 of 9 known tokens, shadowed every
            # 4) came from the pool: the engine ran the last known token, then one per decode step
            resumed = spare.decode.shadow_stats()  # type: ignore[union-attr]
            assert (resumed.num_resumed_blocks, resumed.num_resumed_tokens) == (5, 64 + 8)
            assert forwarded == (53 + len(done) - 72) + (params.max_tokens - len(done) - 1)
        finally:
            first.close()
            spare.close()

    asyncio.run(main())


def test_finished_request_drops_its_shadows(tiny_model_dir: Path, tmp_path: Path) -> None:
    prompt = random_tokens(40, seed=12)
    req = GenerationRequest("f", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                            shadow_salt="feed")

    async def main() -> None:
        pool, _ = make_pool(tmp_path)
        cluster = await LocalCluster.start(_cfg(tiny_model_dir, "float32"), pool=pool, decode_pool=True)
        try:
            run = await cluster.run(req)
            assert cluster.decode is not None and cluster.decode.pool is not None
            assert await asyncio.to_thread(cluster.decode.pool.flush, 10.0)
            stats = cluster.decode.shadow_stats()
            assert stats is not None and stats.num_shadowed_blocks >= 3 and stats.num_removed_chains == 1
            assert stats.num_tracked == 0 and stats.num_shadow_blocks == 0
            full = replace(req, output_token_ids=tuple(run.token_ids[:-1]))
            assert pool.match_prefix(resume_hashes(full, 16)) == 0
        finally:
            cluster.close()

    asyncio.run(main())


def test_an_aborted_requests_shadows_wait_keep_s_for_a_resume(tiny_model_dir: Path, tmp_path: Path) -> None:
    req = GenerationRequest("a", random_tokens(53, seed=15), GREEDY_LONG, shadow_salt="ab0rt")

    async def main() -> None:
        pool, _ = make_pool(tmp_path)
        cfg = replace(_cfg(tiny_model_dir, "float32"), shadow_keep_s=0.0)
        cluster = await LocalCluster.start(cfg, num_prefill=1, pool=pool, decode_pool=True)
        try:
            done = await _cut_run(cluster, req, CUT)
            hashes = resume_hashes(replace(req, output_token_ids=tuple(done)), 16)
            assert pool.match_prefix(hashes) == 4  # kept after the abort, for a resume
            # the next step of any request drops a kept chain whose time has come
            await cluster.run(GenerationRequest("b", random_tokens(20, seed=16), GREEDY_LONG))
            assert cluster.decode is not None and cluster.decode.pool is not None
            assert await asyncio.to_thread(cluster.decode.pool.flush, 10.0)
            stats = cluster.decode.shadow_stats()
            assert stats is not None and stats.num_kept_chains == 0 and stats.num_removed_chains == 1
            assert pool.match_prefix(hashes) == 0
        finally:
            cluster.close()

    asyncio.run(main())


def _spoil(pool: PrefixCachePool, handles: dict, block_hash: int, how: str, other: bytes) -> None:  # type: ignore[type-arg]
    store = handles[pool.owner(block_hash)].store
    payload = store.get([block_hash])[0]
    assert payload is not None
    bad = {
        "corrupt": payload[:-7] + bytes([payload[-7] ^ 0x40]) + payload[-6:],
        "truncated": payload[: len(payload) // 2],
        "stale": other,  # another request's block (its own hash and epoch) under this key
    }[how]
    store.remove([block_hash])
    store.put([(block_hash, bad)])


@pytest.mark.parametrize("which", ["full", "partial"])
@pytest.mark.parametrize("how", ["corrupt", "truncated", "stale"])
def test_a_bad_shadow_block_becomes_a_recompute(tiny_model_dir: Path, tmp_path: Path, how: str, which: str) -> None:
    prompt = random_tokens(53, seed=13)
    req = GenerationRequest("v", prompt, GREEDY_LONG, shadow_salt="5a1t")
    other = GenerationRequest("w", random_tokens(53, seed=14), GREEDY_LONG, shadow_salt="0ther")

    async def main() -> None:
        pool, handles = make_pool(tmp_path)
        cfg = _cfg(tiny_model_dir, "float32")
        first = await LocalCluster.start(cfg, num_prefill=1, pool=pool, decode_pool=True)
        spare = await LocalCluster.start(cfg, num_prefill=0, pool=pool, decode_pool=True)
        try:
            whole = streamed_ids((await first.run(replace(req, request_id="whole", shadow_salt=None))).events)
            other_done = await _cut_run(first, other, CUT)
            done = await _cut_run(first, req, CUT)
            hashes = resume_hashes(replace(req, output_token_ids=tuple(done)), 16)
            other_hashes = resume_hashes(replace(other, output_token_ids=tuple(other_done)), 16)
            stale = handles[pool.owner(other_hashes[2])].store.get([other_hashes[2]])[0]
            tokens = prompt + done
            partial = partial_hash(hashes[3], tokens[64:72], shadow_keys(req))  # 8 of the 9 tokens after them
            _spoil(pool, handles, hashes[2] if which == "full" else partial, how, stale)

            rest, forwarded = await _resume(spare, req, done)
            assert done + rest == whole  # float32: a recompute of the spoiled blocks gives the same tokens
            # after a bad full block nothing more is imported; after a bad partial one, the 4 full blocks
            imported = 32 if which == "full" else 64
            assert spare.decode.shadow_stats().num_resumed_tokens == imported  # type: ignore[union-attr]
            assert forwarded == (53 + len(done) - imported) + (GREEDY_LONG.max_tokens - len(done) - 1)
        finally:
            first.close()
            spare.close()

    asyncio.run(main())


def test_no_pool_means_no_shadows(tiny_model_dir: Path) -> None:
    async def main() -> None:
        cluster = await LocalCluster.start(_cfg(tiny_model_dir, "float32"))
        try:
            assert cluster.decode is not None and cluster.decode.shadow_stats() is None
            run = await cluster.run(GenerationRequest("n", random_tokens(30, seed=1), GREEDY_LONG, shadow_salt="x"))
            assert len(run.token_ids) == GREEDY_LONG.max_tokens
        finally:
            cluster.close()

    asyncio.run(main())



def test_a_shadowed_batch_request_offloaded_for_an_interactive_one_keeps_its_tokens(tiny_model_dir: Path,
                                                                                    tmp_path: Path) -> None:
    """The decode engine has one row: the interactive request takes the batch request's row (its KV
    goes to host memory), and the batch request, shadowed all along, finishes as it would alone."""
    batch = GenerationRequest("b", random_tokens(53, seed=13), GREEDY_LONG, shadow_salt="b0", priority_rank=1)
    chat = GenerationRequest("c", random_tokens(40, seed=14), SamplingParams(max_tokens=8, temperature=0,
                                                                             ignore_eos=True))

    async def main() -> None:
        pool, _ = make_pool(tmp_path)
        one_row = worker_config(tiny_model_dir, engine=EngineConfig(num_blocks=NUM_BLOCKS, max_num_seqs=1))
        alone = await LocalCluster.start(worker_config(tiny_model_dir), pool=pool, decode_pool=True)
        cluster = await LocalCluster.start(one_row, pool=pool, decode_pool=True)
        try:
            want = streamed_ids((await alone.run(replace(batch, request_id="b-alone"))).events)
            decode = cluster.decode
            assert decode is not None and await decode.announce(batch)
            await cluster.prefills[0].prefill(batch, cluster.peer)
            stream = decode.generate_after_kv("b")
            got = []
            async for event in stream:
                got += event.output.new_token_ids
                if len(got) >= 10:
                    break
            chat_run = asyncio.ensure_future(cluster.run(chat))  # no row left: the batch request's is taken
            async for event in stream:
                got += event.output.new_token_ids
            assert len((await chat_run).events) > 0
            assert got == want
            assert decode.engine.engine.stats().num_offloads == 1
            assert decode.shadow_stats().num_shadowed_blocks >= 4  # type: ignore[union-attr]
        finally:
            alone.close()
            cluster.close()

    asyncio.run(main())
