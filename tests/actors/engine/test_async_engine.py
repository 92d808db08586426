import asyncio
import threading
import time

import pytest

import actors.engine.async_engine as async_engine_module
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


def test_stream_interval_sends_fewer_deltas_with_the_same_tokens(tiny_llama_dir):
    prompts = [[5 + i, 17, 29, 31 + i, 40] for i in range(4)]
    params = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, logprobs=1)
    want = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64)).generate(prompts, params)
    engine = AsyncEngine(Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64)), stream_interval=4)

    async def one(i: int):  # type: ignore[no-untyped-def]
        return [out async for out in engine.generate(f"r{i}", prompts[i], params)]

    async def main():  # type: ignore[no-untyped-def]
        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        streams = asyncio.run(main())
    finally:
        engine.shutdown()
    for deltas, w in zip(streams, want):
        sizes = [len(d.new_token_ids) for d in deltas]
        assert sizes[0] == 1  # the first token is never held back
        assert all(n >= 4 for n in sizes[1:-1]) and len(deltas) <= 1 + -(-10 // 4)
        assert [t for d in deltas for t in d.new_token_ids] == list(w.token_ids)
        assert "".join(d.new_text for d in deltas) == w.text
        assert sum(len(d.logprobs) for d in deltas) == 11 and deltas[-1].finished
        assert deltas[-1].token_ids == w.token_ids and deltas[-1].text == w.text


def test_outputs_merge_in_order_and_only_within_a_request():
    from actors.engine.output import RequestOutput

    a = RequestOutput("r", (1,), "a", "a", (1,), logprobs=(None,))
    b = RequestOutput("r", (2, 3), "bc", "abc", (1, 2, 3), logprobs=(None, None), finished=True,
                      finish_reason="length")
    m = a.followed_by(b)
    assert (m.new_token_ids, m.new_text, m.text, m.token_ids) == ((1, 2, 3), "abc", "abc", (1, 2, 3))
    assert len(m.logprobs) == 3 and m.finished and m.finish_reason == "length" and m.time == b.time
    with pytest.raises(ValueError):
        a.followed_by(RequestOutput("other", (2,), "b", "b", (2,)))
    with pytest.raises(ValueError):
        AsyncEngine(None, stream_interval=0)  # type: ignore[arg-type]


def test_tokens_whose_text_is_held_back_never_ride_behind_text():
    # The recovery journal reads a delta with text as covering all of its tokens: a token whose
    # text the detokenizer still holds back (half a UTF-8 character) must go out on its own or
    # with the text that completes it, never merged behind earlier text.
    from actors.engine.output import RequestOutput

    def out(ids, new_text, text, finished=False):  # type: ignore[no-untyped-def]
        return RequestOutput("r", ids, new_text, text, tuple(range(1, ids[-1] + 1)), finished=finished)

    outputs = [out((1,), "a", "a"), out((2,), "b", "ab"), out((3,), "", "ab"), out((4,), "", "ab"),
               out((5,), "é", "abé"), out((6,), "", "abé"), out((7,), "!", "abé!", finished=True)]

    async def run(interval: int, batches: list[int]) -> list[RequestOutput]:
        engine = AsyncEngine.__new__(AsyncEngine)  # only the stream side: no model, no thread
        engine.stream_interval = interval
        queue: asyncio.Queue = asyncio.Queue()
        got: list[RequestOutput] = []

        async def read() -> None:
            async for d in engine._drain("r", queue):
                got.append(d)

        reader = asyncio.create_task(read())
        it = iter(outputs)
        for n in batches:  # the engine delivers `n` outputs at once, then the reader catches up
            for _ in range(n):
                queue.put_nowait(next(it))
            await asyncio.sleep(0.02)
        await asyncio.wait_for(reader, 5)
        return got

    for interval in (1, 2, 4):
        deltas = asyncio.run(run(interval, [1, 3, 2, 1]))
        assert [t for d in deltas for t in d.new_token_ids] == list(range(1, 8))
        assert "".join(d.new_text for d in deltas) == "abé!" and deltas[-1].finished
        for d in deltas:
            if d.new_text and not d.finished:
                assert d.text == outputs[d.new_token_ids[-1] - 1].text and d.new_token_ids[-1] in (1, 2, 5)


def test_between_steps_never_overlaps_a_forward(async_engine):
    """`locked` calls may land while a forward runs (its requests are `_executing`); `between_steps`
    calls never do, and the engine keeps stepping around them."""
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    def executing() -> int:
        return len(async_engine.engine._executing)

    async def main() -> tuple[list[int], int]:
        stream = asyncio.ensure_future(_drain(async_engine.generate("long", [5, 17, 29, 31], long)))
        seen = []
        while not stream.done():
            seen.append(await asyncio.to_thread(async_engine.between_steps, executing))
        return seen, await stream

    seen, num_tokens = asyncio.run(main())
    assert num_tokens == 200 and len(seen) > 5 and max(seen) == 0


async def _drain(stream) -> int:
    n = 0
    async for out in stream:
        n += len(out.new_token_ids)
    return n


class _ParkRecorder(threading.Event):
    """The engine loop's wake-up event, recording each wait: its timeout, whether it was woken
    (True) or timed out, and that the loop has parked in one."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []
        self.woken: list[bool] = []
        self.parked = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        self.parked.set()
        woken = super().wait(timeout)
        self.woken.append(woken)
        return woken


def test_an_idle_engine_parks_in_its_long_wait_and_new_work_wakes_it(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(async_engine_module, "IDLE_WAIT_S", 3600.0)
    engine = AsyncEngine(Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64)))
    try:
        recorder = _ParkRecorder()
        old, engine._wakeup = engine._wakeup, recorder
        old.set()  # past the wait the loop may already be in
        assert recorder.parked.wait(60), "the idle engine loop never waited"
        assert recorder.timeouts == [3600.0] and recorder.woken == []  # parked in the long wait, nothing to do

        async def run() -> list[int]:
            return [t async for out in engine.generate("r", [5, 17, 29, 31, 40], GREEDY) for t in out.new_token_ids]

        # Only a wake-up gets this request going: a missed one would sleep for the hour (the guard's 120 s first).
        assert len(asyncio.run(asyncio.wait_for(run(), 120))) == GREEDY.max_tokens
        assert recorder.woken[0] is True  # the add woke the parked loop; it did not time out
    finally:
        engine.shutdown()
