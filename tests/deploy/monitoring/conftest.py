"""Fixtures: the OpenAI app over a tiny model with monitoring wired in as the ingress wires it,
served by uvicorn on 127.0.0.1 (lifespan on, so the periodic metrics export runs), plus real
traffic from three tenants: `tenant-a` (has an SLO; repeats one prompt, so the prefix cache hits),
`tenant-b` (no SLO; chat, streamed and not) and `throttled` (refused with 429).

Monitoring is built while Ray's metric classes are swapped for recording fakes (fake_metrics.py),
so tests can read exactly what reached the metrics through HTTP."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
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
from deploy.dashboard import SloTargets
from deploy.dashboard.monitoring import Monitoring
from actors.errors import Refused  # noqa: E402
from deploy.openai import ApiConfig, EngineBackend, build_api
from tests.deploy.monitoring.fake_metrics import Recorded, install
from tests.server_thread import ServerThread

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b", "key-t": "throttled"}
NUM_BLOCKS = 64
SLOS = {"tenant-a": SloTargets(ttft_ms=2000.0, tpot_ms=500.0)}
PROMPT_A = list(range(3, 43))  # 40 tokens: two full 16-token blocks to reuse


class RefusingBackend(EngineBackend):
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       policy: RequestPolicy) -> AsyncGenerator[RequestOutput, None]:
        if policy.tenant == "throttled":
            raise Refused("tenant_over_budget", retry_after_s=2.0)
        async for out in super().generate(request_id, prompt_token_ids, params, policy=policy):
            yield out


@dataclass
class Served:
    base_url: str
    monitoring: Monitoring
    engine: Engine
    recorded: Recorded


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    model = write_tiny_model(tmp_path_factory.mktemp("tiny-monitoring"), seed=0, max_position_embeddings=256)
    engine = Engine.from_pretrained(model, EngineConfig(num_blocks=NUM_BLOCKS))
    async_engine = AsyncEngine(engine)
    with pytest.MonkeyPatch.context() as patch:
        recorded = install(patch)  # the instruments are made now; the fakes keep recording afterwards
        backend = RefusingBackend(async_engine, "tiny")
        # A window longer than any session: the traffic runs once, and a test reading it minutes later
        # (a slow box, xdist ordering) must still see every request in it.
        monitoring = Monitoring(backend, slos=SLOS, period_s=0.2, window_s=3600.0)
    app = build_api(backend, ApiConfig(api_keys=KEYS))
    monitoring.mount(app)
    try:
        with ServerThread(app, lifespan="on") as server:
            yield Served(server.base_url, monitoring, engine, recorded)
    finally:
        async_engine.shutdown()


@pytest.fixture(scope="session")
def traffic(served: Served) -> Served:
    """Runs the requests once per session; every monitoring test reads their traces."""
    url = served.base_url

    def post(path: str, key: str, body: dict[str, object]) -> httpx2.Response:
        return httpx2.post(url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)

    for max_tokens in (4, 6, 8):
        r = post("/v1/completions", "key-a", {"model": "tiny", "prompt": PROMPT_A, "max_tokens": max_tokens,
                                              "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    for stream in (False, True):
        r = post("/v1/chat/completions", "key-b", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 5, "stream": stream})
        assert r.status_code == 200, r.text
    r = post("/v1/completions", "key-t", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 429, r.text
    time.sleep(0.5)  # two export periods: the cluster metrics saw the engine after the traffic
    return served


def chromium_path() -> Path | None:
    for candidate in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if Path(candidate).exists():
            return Path(candidate)
    return None
