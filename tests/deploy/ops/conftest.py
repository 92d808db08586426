"""Fixtures: the OpenAI app on a tiny model served in-process, with a recorder and a scripted backend.

Mental model: `ferry status` and the batch runner are HTTP clients, so they are tested against a
real server (uvicorn on 127.0.0.1, a daemon thread) over a real engine. An ASGI `Recorder` in front
of the app logs every POST (path, SLO-class header, JSON body): that is how tests count what the
server actually received, e.g. that a resumed batch sent no line twice. `ScriptedBackend` misbehaves
on request by sampling seed: it refuses (429) the first `refusals[seed]` requests with that seed,
and crashes (500) on `CRASH_SEED`; `delay_s` slows every request down. One server serves the
whole package (the model loads once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Before anything imports ray: every Ray port binds 127.0.0.1, and the test cluster runs without
# Ray's token auth (it is reachable from this machine only).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402
from tests.server_thread import ServerThread  # noqa: E402
from starlette.types import ASGIApp, Message, Receive, Scope, Send  # noqa: E402

from actors.messages import RequestPolicy
from actors.engine.async_engine import AsyncEngine  # noqa: E402
from actors.engine.config import EngineConfig  # noqa: E402
from actors.engine.engine import Engine  # noqa: E402
from actors.engine.output import RequestOutput  # noqa: E402
from actors.engine.sampling import SamplingParams  # noqa: E402
from actors.engine.tiny_model import write_tiny_model  # noqa: E402
from actors.errors import Refused  # noqa: E402
from deploy.openai import ApiConfig, EngineBackend, build_api  # noqa: E402
from deploy.ops import add_ops_parsers  # noqa: E402

CRASH_SEED = 500
REFUSE_SEED = 429
RETRY_AFTER_S = 1.0  # what the refusals ask for (the app rounds Retry-After up to whole seconds)


@dataclass
class Seen:
    path: str
    slo_class: str | None
    body: dict[str, Any]


class Recorder:
    """ASGI wrapper that records each POST once its whole body has arrived."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: list[Seen] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        chunks: list[bytes] = []

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.seen.append(Seen(scope["path"], headers.get("x-ferry-slo-class"),
                                          json.loads(b"".join(chunks) or b"null")))
            return message

        await self.app(scope, recording_receive, send)


class ScriptedBackend(EngineBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.refusals: dict[int, int] = {}  # seed -> refusals left
        self.num_refused = 0
        self.health_override: dict[str, Any] | None = None
        self.delay_s = 0.0  # before each request: lets a test stop a batch job midway

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       policy: RequestPolicy) -> AsyncGenerator[RequestOutput, None]:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if params.seed == CRASH_SEED:
            raise RuntimeError("scripted crash")
        if self.refusals.get(params.seed or -1, 0) > 0:
            self.refusals[params.seed or -1] -= 1
            self.num_refused += 1
            raise Refused("scripted_refusal", retry_after_s=RETRY_AFTER_S)
        async with aclosing(super().generate(request_id, prompt_token_ids, params, policy=policy)) as stream:
            async for out in stream:
                yield out

    async def health(self) -> dict[str, Any]:
        if self.health_override is not None:
            return self.health_override
        return await super().health()


@dataclass
class App:
    base_url: str
    backend: ScriptedBackend
    recorder: Recorder
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="session")
def app_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-ops"), seed=0, max_position_embeddings=512)
    async_engine = AsyncEngine(Engine.from_pretrained(model_dir, EngineConfig(num_blocks=128)))
    backend = ScriptedBackend(async_engine, "tiny")
    recorder = Recorder(build_api(backend, ApiConfig(auth_required=False, default_max_tokens=4)))
    try:
        with ServerThread(recorder) as server:
            yield App(server.base_url, backend, recorder)
    finally:
        async_engine.shutdown()


@pytest.fixture
def app(app_server: App) -> App:
    """The shared server with a clean slate: nothing recorded, no scripted refusals, real health."""
    app_server.recorder.seen.clear()
    app_server.backend.refusals.clear()
    app_server.backend.num_refused = 0
    app_server.backend.health_override = None
    app_server.backend.delay_s = 0.0
    return app_server


def ferry(argv: list[str]) -> int:
    """Runs `ferry <argv>` through the ops subcommands (what deploy/cli.py wires in)."""
    parser = argparse.ArgumentParser(prog="ferry")
    add_ops_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def batch_request(i: int, *, chat: bool | None = None, **body: Any) -> dict[str, Any]:
    """Input line i: even lines chat, odd lines completions (unless `chat` says), greedy, 3 tokens."""
    chat = i % 2 == 0 if chat is None else chat
    payload: dict[str, Any] = {"model": "tiny", "max_tokens": 3, "temperature": 0}
    if chat:
        payload["messages"] = [{"role": "user", "content": f"question number {i}"}]
    else:
        payload["prompt"] = f"prompt number {i}"
    payload.update(body)
    return {"custom_id": f"req-{i}", "method": "POST",
            "url": "/v1/chat/completions" if chat else "/v1/completions", "body": payload}


def write_jsonl(path: Path, objs: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
