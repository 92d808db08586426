"""The semantic cache through the real HTTP app: `build_api(EngineBackend(AsyncEngine(tiny model)))`
served by uvicorn, the real MiniLM embedder, a cache folder under tmp. A paraphrase of an answered
prompt comes back from the cache (header, similarity, same text) without any engine work; other
tenants, sampled requests and requests that did not opt in go to the engine. The cache `build_api`
makes from the config is saved when the app stops and reloaded by the next one."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import pytest
from pydantic import ValidationError

from actors.messages import RequestPolicy
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.output import RequestOutput
from actors.engine.sampling import SamplingParams
from actors.engine.tiny_model import write_tiny_model
from actors.semantic_cache.embedder import shared_minilm
from actors.semantic_cache.persist import MANIFEST
from actors.semantic_cache.service import SemanticCacheService
from deploy.openai import ApiConfig, EngineBackend, build_api
from deploy.semantic import SemanticCacheSettings, SemanticGlue
from tests.server_thread import ServerThread

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b", "key-c": "tenant-c"}
THRESHOLD = 0.8
FIRST = "What is the capital of France?"
PARAPHRASE = "Which city is the capital of France?"


class CountingBackend(EngineBackend):
    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.num_generate = 0

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       policy: RequestPolicy) -> AsyncGenerator[RequestOutput, None]:
        self.num_generate += 1
        async for out in super().generate(request_id, prompt_token_ids, params, policy=policy):
            yield out


@dataclass
class Served:
    base_url: str
    backend: CountingBackend
    engine: Engine
    glue: SemanticGlue


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-semantic"), seed=0)
    engine = Engine.from_pretrained(model_dir, EngineConfig(num_blocks=64))
    async_engine = AsyncEngine(engine)
    backend = CountingBackend(async_engine, "tiny")
    settings = SemanticCacheSettings(threshold=THRESHOLD, tenants=["tenant-c"], batch_window_ms=1,
                                     folder=str(tmp_path_factory.mktemp("sc")))
    glue = SemanticGlue(settings, SemanticCacheService.open(settings.cache_config(), settings.service_config(),
                                                            shared_minilm()))
    cfg = ApiConfig(api_keys=KEYS, default_max_tokens=6)
    try:
        with ServerThread(build_api(backend, cfg, semantic=glue)) as server:
            yield Served(server.base_url, backend, engine, glue)
    finally:
        async_engine.shutdown()


def chat(served: Served, text: str, *, key: str = "key-a", opt_in: bool = True, stream: bool = False,
         temperature: float = 0.0) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if opt_in:
        headers["x-ferry-semantic-cache"] = "on"
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "temperature": temperature,
            "stream": stream}
    r = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


def wait_size(served: Served, size: int) -> None:
    deadline = time.monotonic() + 30  # inserts run after the answer, in a thread
    worker = served.glue.cache.worker  # type: ignore[attr-defined]
    while worker.stats().size < size:
        assert time.monotonic() < deadline, worker.stats()
        time.sleep(0.05)


def streamed_text(r: httpx.Response) -> str:
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if json.loads(e)["choices"])


def test_paraphrase_is_served_from_cache_without_engine_work(served: Served) -> None:
    first = chat(served, FIRST)
    assert first.headers["x-ferry-cache"] == "miss" and "x-ferry-cache-similarity" not in first.headers
    wait_size(served, 1)
    calls, steps = served.backend.num_generate, served.engine.stats().num_steps
    second = chat(served, PARAPHRASE)
    assert second.headers["x-ferry-cache"] == "semantic"
    assert THRESHOLD <= float(second.headers["x-ferry-cache-similarity"]) <= 1.0
    answer = first.json()["choices"][0]["message"]["content"]
    assert second.json()["choices"][0]["message"]["content"] == answer
    assert second.json()["usage"]["completion_tokens"] == first.json()["usage"]["completion_tokens"]
    assert second.json()["id"] != first.json()["id"]
    streamed = chat(served, PARAPHRASE, stream=True)
    assert streamed.headers["x-ferry-cache"] == "semantic" and streamed_text(streamed) == answer
    assert (served.backend.num_generate, served.engine.stats().num_steps) == (calls, steps)


def test_other_tenant_sampling_and_no_opt_in_reach_the_engine(served: Served) -> None:
    chat(served, FIRST)  # tenant-a's entry exists (or is made) first
    wait_size(served, 1)
    calls = served.backend.num_generate
    assert chat(served, FIRST, key="key-b").headers["x-ferry-cache"] == "miss"  # never across tenants
    assert "x-ferry-cache" not in chat(served, FIRST, temperature=0.7).headers  # sampled: not consulted
    assert "x-ferry-cache" not in chat(served, FIRST, opt_in=False).headers
    assert served.backend.num_generate == calls + 3


def test_tenant_opted_in_by_config(served: Served) -> None:
    assert chat(served, "Explain how photosynthesis works.", key="key-c", opt_in=False).headers[
        "x-ferry-cache"] == "miss"
    wait_size(served, 3)
    r = chat(served, "Can you explain the process of photosynthesis?", key="key-c", opt_in=False)
    assert r.headers["x-ferry-cache"] == "semantic"


@pytest.mark.parametrize("threshold", [-0.1, 1.5])
def test_threshold_outside_unit_interval_is_refused(threshold: float) -> None:
    with pytest.raises(ValidationError, match="threshold"):
        ApiConfig(api_keys=KEYS, semantic_cache={"threshold": threshold})  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="extra"):
        SemanticCacheSettings(thresold=0.9)  # type: ignore[call-arg]


def test_cache_from_the_config_is_saved_at_shutdown_and_reloaded(served: Served, tmp_path: Path) -> None:
    # build_api's own in-process cache (no Ray): a clean stop (lifespan end) saves, a new app reloads.
    settings = {"folder": str(tmp_path), "threshold": THRESHOLD, "save_interval_s": None, "batch_window_ms": 1}
    cfg = ApiConfig(api_keys=KEYS, default_max_tokens=6, semantic_cache=settings)  # type: ignore[arg-type]
    app = build_api(served.backend, cfg)
    with ServerThread(app, lifespan="on") as server:
        here = Served(server.base_url, served.backend, served.engine, app.state.semantic)
        answer = chat(here, FIRST).json()["choices"][0]["message"]["content"]
        wait_size(here, 1)
        assert not (tmp_path / MANIFEST).exists()  # no timer, under 64 inserts: not saved yet
    assert (tmp_path / MANIFEST).exists()
    again = build_api(served.backend, cfg)
    with ServerThread(again) as server:
        r = chat(Served(server.base_url, served.backend, served.engine, again.state.semantic), PARAPHRASE)
    assert r.headers["x-ferry-cache"] == "semantic" and r.json()["choices"][0]["message"]["content"] == answer
