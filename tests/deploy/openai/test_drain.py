"""A graceful stop over HTTP (deploy/openai/drain.py), on its own server over the tiny model: a
stream in flight when the drain starts runs to its end while new requests get 503 and /health
says draining; a drain that times out reports the requests it leaves behind."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import httpx2
import pytest

from actors.messages import RequestPolicy
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.output import RequestOutput
from actors.engine.sampling import SamplingParams
from actors.engine.tiny_model import write_tiny_model
from deploy.openai import ApiConfig, EngineBackend, build_api
from deploy.openai.drain import DrainState
from tests.server_thread import ServerThread

STEP_S = 0.02  # per token: a 60-token stream lasts over a second


class PacedBackend(EngineBackend):
    """The real engine backend, each output held back by a pause per token it carries, so a stream
    is still running when the test starts the drain."""

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       policy: RequestPolicy) -> AsyncGenerator[RequestOutput, None]:
        async for out in super().generate(request_id, prompt_token_ids, params, policy=policy):
            await asyncio.sleep(STEP_S * len(out.new_token_ids))
            yield out


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, DrainState]]:
    engine = Engine.from_pretrained(write_tiny_model(tmp_path / "tiny", seed=0), EngineConfig(num_blocks=64))
    async_engine = AsyncEngine(engine)
    app = build_api(PacedBackend(async_engine, "tiny"), ApiConfig(auth_required=False))
    try:
        with ServerThread(app) as srv:
            yield srv.base_url, app.state.drain
    finally:
        async_engine.shutdown()


def stream(url: str, max_tokens: int, started: threading.Event, out: list[str]) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx2.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:])
                started.set()


def test_a_drain_lets_the_stream_in_flight_finish_and_refuses_new_requests(server: tuple[str, DrainState]) -> None:
    url, state = server
    started, events = threading.Event(), []
    t = threading.Thread(target=stream, args=(url, 60, started, events))
    t.start()
    assert started.wait(30) and state.in_flight == 1
    result: list[int] = []
    drainer = threading.Thread(target=lambda: result.append(asyncio.run(state.drain(30.0))))
    drainer.start()
    while not state.draining:
        time.sleep(0.005)
    seen = len(events)
    refused = httpx2.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": []}, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    assert refused.json()["error"]["code"] == "server_shutting_down"
    health = httpx2.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.json() == {"healthy": False, "draining": True, "in_flight": 1}
    drainer.join(30)
    t.join(30)
    assert result == [0] and len(events) > seen  # the rest of the stream came after the drain began
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert events[-1] == "[DONE]" and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 60  # the whole stream came through
    assert httpx2.get(f"{url}/v1/models", timeout=10).status_code == 503  # draining is one-way


def test_a_drain_that_times_out_reports_what_is_left(server: tuple[str, DrainState]) -> None:
    url, state = server
    started, events = threading.Event(), []
    t = threading.Thread(target=stream, args=(url, 150, started, events), daemon=True)
    t.start()
    assert started.wait(30)
    t0 = time.monotonic()
    assert asyncio.run(state.drain(0.3)) == 1  # the stream needs ~3 s more
    assert 0.3 <= time.monotonic() - t0 < 2.0 and t.is_alive()
