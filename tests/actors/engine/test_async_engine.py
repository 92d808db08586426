import asyncio
import time

import pytest

from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.errors import EmptyPrompt
from actors.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture()
def async_engine(tiny_llama_dir):
    engine = AsyncEngine(Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64)))
    yield engine
    engine.shutdown()


def test_concurrent_streams_match_sync(async_engine, tiny_llama_dir):
    prompts = [[5 + i, 17, 29, 31 + i, 40] for i in range(6)]
    want = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64)).generate(prompts, GREEDY)

    async def one(i: int) -> tuple[list[int], str]:
        ids: list[int] = []
        text = ""
        async for out in async_engine.generate(f"r{i}", prompts[i], GREEDY):
            ids += out.new_token_ids
            text += out.new_text
        return ids, text

    async def main():
        return await asyncio.gather(*(one(i) for i in range(6)))

    got = asyncio.run(main())
    assert [g[0] for g in got] == [list(w.token_ids) for w in want]
    assert [g[1] for g in got] == [w.text for w in want]


def test_cancelled_consumer_aborts_and_frees(async_engine):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def main():
        agen = async_engine.generate("long", [5, 6, 7], params)
        async for out in agen:
            if len(out.token_ids) >= 3:
                break
        await agen.aclose()
        with pytest.raises(EmptyPrompt):
            async for _ in async_engine.generate("bad", [], params):
                pass

    asyncio.run(main())
    # The abort is fired without waiting (a cancelled consumer must not block on it) and, if the
    # request is in the step being computed, lands at the end of that step: wait a bounded time.
    deadline = time.monotonic() + 10
    while True:
        stats = async_engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_blocks_free == stats.num_blocks_total
    assert stats.num_steps < 200  # aborted long before its 200 tokens
