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


def test_decode_steps_are_paced_to_a_fraction_of_the_tightest_tpot_target(tiny_llama_dir):
    """`decode_pace` 0.5 and a 0.2 s TPOT target: decode-only steps start >= 0.1 s apart (a lower
    bound, which a busy machine only makes longer); the same tokens as unpaced, and a request
    without a target is not paced."""
    engine = AsyncEngine(Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64, decode_pace=0.5)))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def run(rid: str, tpot: float | None) -> tuple[list[int], list[float]]:
        ids, times = [], []
        async for out in engine.generate(rid, [5, 17, 29], params, tpot_target_s=tpot):
            ids += out.new_token_ids
            times += [out.time] * len(out.new_token_ids)
        return ids, times

    try:
        paced_ids, paced = asyncio.run(run("paced", 0.2))
        free_ids, _ = asyncio.run(run("free", None))
    finally:
        engine.shutdown()
    gaps = [b - a for a, b in zip(paced, paced[1:])]
    assert paced_ids == free_ids and len(gaps) == 5
    assert min(gaps[1:]) >= 0.1 - 1e-3  # the first token's step was a prefill: only decode steps pace


def test_pace_only_for_decode_only_steps_and_new_work_is_seen(tiny_llama_dir):
    engine = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64, decode_pace=0.5))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params, tpot_target_s=0.2)
    engine.add_request("b", [8, 9, 10], params, tpot_target_s=0.08)
    engine.add_request("c", [8, 9, 11], params)  # no target: does not pace, does not loosen the others
    prefill = engine.prepare_step()
    assert prefill is not None and engine.pace_s(prefill) == 0.0  # prompts in the step: never paced
    engine.finish_step(prefill, engine.runner.execute(prefill.chunks))
    decode = engine.prepare_step()
    assert decode is not None and engine.pace_s(decode) == pytest.approx(0.04)  # 0.5 x the tightest
    assert not engine.has_new_work(decode)
    engine.add_request("d", [1, 2, 3], params)
    assert engine.has_new_work(decode)
    engine.finish_step(decode, engine.runner.execute(decode.chunks))
    off = Engine.from_pretrained(tiny_llama_dir, EngineConfig(num_blocks=64))
    off.add_request("a", [5, 6, 7], params, tpot_target_s=0.2)
    off.step()
    step = off.prepare_step()
    assert step is not None and off.pace_s(step) == 0.0  # pacing off by default
