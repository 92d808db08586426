"""`x-ferry-speculation` over HTTP, on its own server over the tiny model with speculation on: off
keeps the engine from drafting for that request (its timeline's `decode.spec` shows no drafts), auto
or no header lets it draft, the answer is the same either way, any other value is a 400 naming the
header; `/health` shows the engine's method and acceptance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.spec import SpecConfig
from actors.engine.tiny_model import write_tiny_model
from deploy.openai import ApiConfig, EngineBackend, build_api
from deploy.openai.speculation import parse_speculation
from tests.server_thread import ServerThread

KEY = {"authorization": "Bearer key-a"}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = write_tiny_model(tmp_path_factory.mktemp("tiny-spec"), seed=0)
    spec = SpecConfig(method="early_exit", max_draft_tokens=3, policy="always")  # drafts on every decode step
    async_engine = AsyncEngine(Engine.from_pretrained(model, EngineConfig(num_blocks=64, speculation=spec)))
    app = build_api(EngineBackend(async_engine, "tiny"), ApiConfig(api_keys={"key-a": "tenant-a"}))
    try:
        with ServerThread(app) as srv:
            yield srv.base_url
    finally:
        async_engine.shutdown()


def complete(url: str, header: str | None) -> httpx2.Response:
    headers = dict(KEY) if header is None else {**KEY, "x-ferry-speculation": header}
    body = {"model": "tiny", "prompt": "one two three four", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    return httpx2.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def spec_of(url: str, r: httpx2.Response) -> dict[str, object]:
    timeline = httpx2.get(f"{url}/v1/requests/{r.json()['id']}/timeline", headers=KEY, timeout=10).json()
    return timeline["decode"]["spec"]


def test_off_keeps_the_engine_from_drafting_and_auto_lets_it(url: str) -> None:
    answers, drafted = {}, {}
    for header in (None, "auto", "off", "OFF", "Auto"):
        r = complete(url, header)
        assert r.status_code == 200, r.text
        answers[header] = r.json()["choices"][0]["text"]
        spec = spec_of(url, r)
        drafted[header] = spec["draft_tokens"]
        assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]  # type: ignore[operator]
    assert drafted["off"] == drafted["OFF"] == 0
    assert all(drafted[h] > 0 for h in (None, "auto", "Auto"))  # type: ignore[operator]
    assert len(set(answers.values())) == 1  # greedy output does not depend on speculation
    health = httpx2.get(f"{url}/health", timeout=10).json()
    assert health["speculation"]["method"] == "early_exit" and health["speculation"]["draft_tokens"] >= sum(
        drafted.values())
    assert 0 <= health["speculation"]["acceptance_rate"] <= 1


@pytest.mark.parametrize("value", ["on", "false", "", "off,auto"])
def test_any_other_value_is_a_400_naming_the_header(url: str, value: str) -> None:
    r = complete(url, value)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["code"], error["param"], error["type"]) == ("invalid_header", "x-ferry-speculation",
                                                              "invalid_request_error")
    assert f"Invalid x-ferry-speculation header {value!r}" in error["message"] and "'off'" in error["message"]
    assert r.headers["x-request-id"]


def test_the_key_is_checked_first_and_public_routes_ignore_the_header(url: str) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    r = httpx2.post(f"{url}/v1/completions", json=body, timeout=10,
                    headers={"authorization": "Bearer nope", "x-ferry-speculation": "maybe"})
    assert r.status_code == 401
    assert httpx2.get(f"{url}/health", headers={"x-ferry-speculation": "maybe"}, timeout=10).status_code == 200
    assert (parse_speculation(None), parse_speculation("off"), parse_speculation(" auto ")) == (True, False, True)
    assert parse_speculation("yes") is None
