"""The data plane as Ray actors: 2 prefill + 2 decode + 2 prefix-cache actors on a tiny model, started
once for the module. Outputs equal the single-process engine; the pool serves one prefill worker's
prefix to the other (through its disk tier, bit for bit); tenants stay apart unless opted in; a
killed cache actor costs hits, not requests. The kill test comes after every test that needs
both stores."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.options import RequestOptions
from actors.engine.sampling import SamplingParams
from actors.handoff import kv_layout, prompt_block_hashes
from actors.messages import GenerationRequest, TelemetryCursor, TokenEvent
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.store import PrefixCacheConfig
from actors.worker_config import WorkerConfig
from cluster.router.choice import PlacementChoice
from cluster.router.client import Router
from cluster.router.config import RouterConfig
from cluster.router.ray_handles import router_for
from transfer.codec import decode_shard, encode
from transfer.config import TransferConfig

from .harness import GREEDY, random_tokens, reference, streamed_ids, streamed_text

pytestmark = pytest.mark.ray
MIB = 1 << 20
NUM_BLOCKS = 128


class Deployment:
    def __init__(self, model: Path, tmp: Path) -> None:
        from actors.ray_actors import start_pd

        self.model = model
        self.layout = kv_layout(Engine.from_pretrained(model, EngineConfig(num_blocks=4)))
        # A pool block is one codec shard of one block; DRAM holds one per store, the rest spill.
        self.block_bytes = len(encode(torch.zeros(2, 2, 1, 16, 2, 16), self.layout, block_hashes=[1])[0])
        cache = PrefixCacheConfig(dram_bytes=self.block_bytes + 64, disk_bytes=64 * MIB, disk_dir=str(tmp))
        cfg = WorkerConfig(model=str(model), engine=EngineConfig(num_blocks=NUM_BLOCKS), compression="none",  # exact KV
                           transfer=TransferConfig(send_staging_bytes=8 * MIB, recv_staging_bytes=8 * MIB))
        self.pd = start_pd(cfg, num_prefill=2, num_decode=2, cache=cache, num_cache=2)
        self.prefills = list(self.pd.prefills)
        self.pool = PrefixCachePool(self.pd.stores, timeout_s=5.0)  # the test's own view of the stores

    def client(self, prefill: int) -> Router:
        return router_for(self.pd, RouterConfig(call_timeout_s=30, prefill_timeout_s=60, token_timeout_s=60),
                          prefills=[self.prefills[prefill]])

    async def flush(self, prefill: int) -> None:
        assert await self.pd.prefills[self.prefills[prefill]].flush_offers.remote(30.0)


@pytest.fixture(scope="module")
def pd(ray_cluster: ModuleType, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    deployment = Deployment(tiny_model_dir, tmp_path_factory.mktemp("pd-cache"))
    try:
        yield deployment
    finally:
        deployment.pd.shutdown()


async def collect(client: Router, req: GenerationRequest) -> list[TokenEvent]:
    return [event async for event in client.generate(req)]


def test_twenty_concurrent_prompts_match_the_single_engine(pd: Deployment) -> None:
    prefix_a, prefix_b = random_tokens(48, seed=200), random_tokens(64, seed=201)
    prompts = [prefix_a + random_tokens(n, seed=210 + n) for n in (3, 9, 16, 21, 30, 1)]
    prompts += [prefix_b + random_tokens(n, seed=220 + n) for n in (2, 7, 17, 25, 33, 40)]
    prompts += [random_tokens(n, seed=230 + n) for n in (1, 2, 16, 17, 33, 50, 75, 90)]
    want = reference(pd.model, prompts, GREEDY)

    async def main() -> list[list[TokenEvent]]:
        client = pd.client(prefill=0)
        return await asyncio.gather(*(collect(client, GenerationRequest(f"many-{i}", p, GREEDY))
                                      for i, p in enumerate(prompts)))

    runs = asyncio.run(main())
    assert [streamed_ids(r) for r in runs] == want
    texts = [streamed_text(r) for r in runs]
    assert texts == [r[-1].output.text for r in runs]
    assert {e.worker for r in runs for e in r} == set(pd.pd.decodes)  # both decode workers served
    for r in runs:
        times = [e.emitted_at for e in r]
        assert times == sorted(times) and r[-1].output.finished

    async def loads() -> list:
        return await asyncio.gather(*(h.load.remote() for h in pd.pd.decodes.values()))

    for load in asyncio.run(loads()):
        assert (load.num_running, load.num_reserved, load.num_free_blocks) == (0, 0, NUM_BLOCKS)


def test_pool_serves_a_prefix_to_another_prefill_worker_through_disk(pd: Deployment) -> None:
    prefix = random_tokens(64, seed=300)
    first, second = prefix + random_tokens(6, seed=301), prefix + random_tokens(11, seed=302)
    want = reference(pd.model, [first, second], GREEDY)
    hashes = prompt_block_hashes(GenerationRequest("a", first, GREEDY), 16)

    async def main() -> tuple[list[TokenEvent], list[TokenEvent], Router]:
        a = await collect(pd.client(0), GenerationRequest("pool-a", first, GREEDY))
        await pd.flush(0)
        client = pd.client(1)
        b = await collect(client, GenerationRequest("pool-b", second, GREEDY))
        return a, b, client

    a, b, client = asyncio.run(main())
    assert [streamed_ids(a), streamed_ids(b)] == want
    result = client.prefill_result("pool-b")
    assert result is not None
    assert (result.num_local_hit_blocks, result.num_pool_hit_blocks) == (0, 4)
    assert result.num_computed_tokens == len(second) - 64

    # One block of DRAM per store: fetching the 4-block chain must read some from disk, and what
    # comes back passes the codec's crc32, which the prefill worker computed before the put.
    before = pd.pool.stats().total
    payloads = pd.pool.get_prefix(hashes)
    after = pd.pool.stats().total
    assert len(payloads) == 4 and after.num_hits_disk > before.num_hits_disk
    assert after.num_dram_blocks == 2 and after.num_disk_blocks > 0
    again = pd.pool.get_prefix(hashes)
    assert again == payloads  # bytes that went DRAM -> disk -> DRAM are unchanged
    engine = Engine.from_pretrained(pd.model, EngineConfig(num_blocks=16))
    engine.add_request("ref", first, GREEDY, RequestOptions(hold_kv=True))
    while engine.has_unfinished_requests():
        engine.step()
    want_kv = engine.runner.read_blocks(engine.held_kv("ref")[0][:4])
    for j, payload in enumerate(payloads):
        shard = decode_shard(payload, pd.layout)
        assert shard.header.block_hashes == (hashes[j],)
        torch.testing.assert_close(shard.kv, want_kv[:, :, j : j + 1], atol=1e-5, rtol=1e-5)


def test_tenants_do_not_share_blocks_unless_opted_in(pd: Deployment) -> None:
    prompt = random_tokens(60, seed=400)  # 3 reusable blocks
    (want,) = reference(pd.model, [prompt], GREEDY)

    async def run(rid: str, prefill: int, tenant: str, shared: int = 0) -> tuple[list[int], int, int]:
        client = pd.client(prefill)
        events = await collect(client, GenerationRequest(rid, prompt, GREEDY, tenant=tenant,
                                                         num_shared_prefix_tokens=shared))
        await pd.flush(prefill)
        result = client.prefill_result(rid)
        assert result is not None
        return streamed_ids(events), result.num_pool_hit_blocks, result.num_computed_tokens

    async def main() -> list[tuple[list[int], int, int]]:
        return [await run("t-a", 0, "acme"), await run("t-b", 1, "globex"),
                await run("t-c", 0, "initech", shared=32), await run("t-d", 1, "hooli", shared=32)]

    a, b, c, d = asyncio.run(main())
    assert a == (want, 0, 60) and b == (want, 0, 60)  # same prompt, other tenant: nothing reused
    assert c == (want, 0, 60)
    assert d == (want, 2, 60 - 32)  # only the opted-in 32-token prefix is shared


def test_killed_cache_actor_turns_into_misses(pd: Deployment, ray_cluster: ModuleType) -> None:
    prefix = random_tokens(64, seed=500)
    first, second, third = (prefix + random_tokens(n, seed=500 + n) for n in (5, 8, 13))
    want = reference(pd.model, [first, second, third], GREEDY)
    hashes = prompt_block_hashes(GenerationRequest("k", first, GREEDY), 16)
    owners = [pd.pool.owner(h) for h in hashes]
    victim = owners[1]
    first_lost = owners.index(victim)

    async def main() -> list[tuple[list[int], int]]:
        got = [streamed_ids(await collect(pd.client(0), GenerationRequest("kill-a", first, GREEDY)))]
        await pd.flush(0)
        ray_cluster.kill(pd.pd.stores[victim].actor, no_restart=True)
        hits = []
        client = pd.client(1)
        for rid, prompt in (("kill-b", second), ("kill-c", third)):
            got.append(streamed_ids(await collect(client, GenerationRequest(rid, prompt, GREEDY))))
            result = client.prefill_result(rid)
            assert result is not None
            hits.append((result.num_local_hit_blocks, result.num_pool_hit_blocks))
        return list(zip(got, [(0, 0), *hits]))

    (a, _), (b, b_hits), (c, c_hits) = asyncio.run(main())
    assert [a, b, c] == want
    assert b_hits == (0, first_lost)  # the chain stops at the dead store's first block
    assert c_hits == (4, 0)  # prefill 1 computed the rest and holds the prefix itself now


class _LocalPrefill:
    """The placement a scheduler makes for a local prefill: no prefill worker, decode worker `d`
    prefills the prompt itself in chunks of `chunk` tokens (None: its engine's budget)."""

    def __init__(self, decode: str, chunk: int | None) -> None:
        self.decode, self.chunk = decode, chunk

    def place(self, req: GenerationRequest, prefills: object, decodes: object,
              decided: object = None) -> PlacementChoice:
        return PlacementChoice(None, (self.decode,), local_chunk_tokens=self.chunk)


def test_a_local_prefill_runs_on_its_decode_worker_in_the_chunks_it_was_placed_with(pd: Deployment) -> None:
    prompt = random_tokens(50, seed=700)
    want = reference(pd.model, [prompt], GREEDY)
    name = sorted(pd.pd.decodes)[0]
    handle = pd.pd.decodes[name]
    cfg = RouterConfig(call_timeout_s=30, prefill_timeout_s=60, token_timeout_s=60)
    long_row = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)

    async def main() -> tuple[list[TokenEvent], tuple[int, ...]]:
        # A row decoding on that worker the whole time: the chunks are there to protect it.
        rows = router_for(pd.pd, cfg, policy=_LocalPrefill(name, None))
        row_req = GenerationRequest("row", random_tokens(5, seed=701), long_row)
        async with contextlib.aclosing(rows.generate(row_req)) as row:
            await anext(row)
            before = await handle.telemetry.remote()
            cursor = TelemetryCursor(before.incarnation, before.first_step_seq + len(before.steps) - 1,
                                     before.cache_seq)
            client = router_for(pd.pd, cfg, policy=_LocalPrefill(name, 8))
            events = await collect(client, GenerationRequest("local-chunks", prompt, GREEDY))
            after = await handle.telemetry.remote(cursor)
            assert [s.num_decode_seqs for s in after.steps if s.num_prefill_tokens] == [1] * 7  # the row decoded
        return events, tuple(s.num_prefill_tokens for s in after.steps if s.num_prefill_tokens)

    events, chunks = asyncio.run(main())
    assert [streamed_ids(events)] == want and {e.worker for e in events} == {name}
    assert chunks == (8,) * 6 + (2,)  # the whole 50-token prompt, 8 tokens a step


def test_colocated_actor_streams_the_single_engine_output(pd: Deployment, ray_cluster: ModuleType) -> None:
    from actors.ray_actors import RemoteColocated

    prompts = [random_tokens(n, seed=600 + n) for n in (1, 20, 45)]
    want = reference(pd.model, prompts, GREEDY)
    actor = RemoteColocated.remote(WorkerConfig(model=str(pd.model), engine=EngineConfig(num_blocks=32)), "colo")

    async def one(i: int, prompt: list[int]) -> list[TokenEvent]:
        stream = actor.generate.options(num_returns="streaming").remote(GenerationRequest(f"colo-{i}", prompt, GREEDY))
        return [await ref async for ref in stream]

    async def main() -> list[list[TokenEvent]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        runs = asyncio.run(main())
        assert [streamed_ids(r) for r in runs] == want
        assert {e.worker for r in runs for e in r} == {"colo"}
        load = ray_cluster.get(actor.load.remote(), timeout=30)
        assert (load.kind, load.num_running, load.num_free_blocks) == ("colocated", 0, 32)
    finally:
        ray_cluster.kill(actor, no_restart=True)
