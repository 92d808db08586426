"""Fixtures: the OpenAI app over an `EngineBackend` on a tiny random model, served for real.

Mental model: tests talk HTTP to uvicorn on 127.0.0.1 (a free port, a background thread), so
they exercise what clients see: status lines, headers, SSE framing, disconnects. One server is
shared by the whole package (the model loads once); each test still gets exact answers because
the tiny model is seeded and greedy decoding is deterministic. Tenants `throttled`, `broken` and
`flaky` are scripted to refuse, to crash, and to crash mid-stream (the 429 and 500 paths).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import pytest


from actors.messages import RequestPolicy
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.output import RequestOutput
from actors.engine.sampling import SamplingParams
from actors.engine.tiny_model import write_tiny_model
from actors.errors import Refused  # noqa: E402
from deploy.openai import ApiConfig, EngineBackend, build_api
from tests.server_thread import ServerThread

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b", "key-throttled": "throttled", "key-broken": "broken",
        "key-flaky": "flaky"}
MAX_BODY_BYTES = 16 * 1024
MAX_MODEL_LEN = 4096  # long enough that a request left running outlives every bounded wait
NUM_BLOCKS = 320  # 5120 tokens: one request of MAX_MODEL_LEN plus a few short ones
SECRET = "secret-detail-/srv/ferry/weights"


class ScriptedBackend(EngineBackend):
    """EngineBackend whose `throttled` tenant is refused, whose `broken` tenant crashes at once, and
    whose `flaky` tenant crashes after its second output."""

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       policy: RequestPolicy) -> AsyncGenerator[RequestOutput, None]:
        if policy.tenant == "throttled":
            raise Refused("tenant_over_budget", retry_after_s=2.5)
        if policy.tenant == "broken":
            raise RuntimeError(SECRET)
        # aclosing: closing this generator must close the engine's, or the request is never aborted.
        async with aclosing(super().generate(request_id, prompt_token_ids, params, policy=policy)) as stream:
            num_outputs = 0
            async for out in stream:
                if policy.tenant == "flaky" and num_outputs == 2:
                    raise RuntimeError(SECRET)
                num_outputs += 1
                yield out


@dataclass
class Served:
    base_url: str
    backend: ScriptedBackend
    engine: Engine
    cfg: ApiConfig


def serve(backend: EngineBackend, cfg: ApiConfig) -> ServerThread:
    return ServerThread(build_api(backend, cfg))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-openai"), seed=0, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=NUM_BLOCKS))
    async_engine = AsyncEngine(engine)
    backend = ScriptedBackend(async_engine, "tiny")
    cfg = ApiConfig(api_keys=KEYS, max_body_bytes=MAX_BODY_BYTES, served_model_names=["tiny", "tiny-alias"],
                    default_max_tokens=8)
    try:
        with serve(backend, cfg) as server:
            yield Served(server.base_url, backend, engine, cfg)
    finally:
        async_engine.shutdown()
