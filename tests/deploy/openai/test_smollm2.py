"""The real model behind the HTTP API: SmolLM2-135M-Instruct answers a factual chat question, and
streaming returns the same text as the one-shot answer."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from deploy.openai import ApiConfig, EngineBackend
from tests.deploy.openai.conftest import serve

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    from actors.engine.errors import ModelFetchError
    from actors.engine.fetch import fetch_model

    try:
        path = fetch_model("smollm2")
    except ModelFetchError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
    async_engine = AsyncEngine(Engine.from_pretrained(path, EngineConfig(kv_cache_bytes=64 << 20)))
    cfg = ApiConfig(api_keys={"sk-test": "acme"}, served_model_names=["smollm2"])
    try:
        with serve(EngineBackend(async_engine, "smollm2"), cfg) as server:
            with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-test", max_retries=0, timeout=60) as c:
                yield c
    finally:
        async_engine.shutdown()


def test_capital_of_france(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24)
    answer = got.choices[0].message.content
    assert answer is not None and "Paris" in answer
    assert got.choices[0].finish_reason == "stop"
    assert got.usage is not None and got.usage.completion_tokens <= 24

    chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == got.usage.completion_tokens
    # Same tenant, same prompt: every full block but the last token's comes from the prefix cache.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16
