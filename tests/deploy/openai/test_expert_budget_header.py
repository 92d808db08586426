"""`x-ferry-expert-budget` over HTTP, on its own server over a tiny random Mixtral (4 experts per
layer, top-2): a valid budget reaches the engine's expert-budget tracker as the request's own
budget, no header sets none, and anything but a whole number in [1, 4] is a 400 naming the header;
a dense model refuses any budget."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.moe.control import install_moe_control
from actors.engine.tiny_model import write_tiny_model
from deploy.openai import ApiConfig, EngineBackend, build_api
from deploy.openai.expert_budget import over_model, parse_expert_budget
from tests.server_thread import ServerThread

KEY = {"authorization": "Bearer key-a"}
HEADER = "x-ferry-expert-budget"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[tuple[str, int | None]]]]:
    model = write_tiny_model(tmp_path_factory.mktemp("tiny-moe-header"), moe=True, seed=1)
    engine = Engine.from_pretrained(model, EngineConfig(num_blocks=64, device="cpu", dtype="float32"))
    control = install_moe_control(engine)
    assert control is not None
    budgets: list[tuple[str, int | None]] = []
    inner = control.budget.set_request_budget

    def recorded(request_id: str, num_experts: int | None) -> None:
        budgets.append((request_id, num_experts))
        inner(request_id, num_experts)

    control.budget.set_request_budget = recorded  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine)
    app = build_api(EngineBackend(async_engine, "tiny"), ApiConfig(api_keys={"key-a": "tenant-a"}))
    try:
        with ServerThread(app) as srv:
            yield srv.base_url, budgets
    finally:
        async_engine.shutdown()


def complete(url: str, header: str | None) -> httpx2.Response:
    headers = dict(KEY) if header is None else {**KEY, HEADER: header}
    body = {"model": "tiny", "prompt": "one two three four", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return httpx2.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def test_a_valid_budget_is_the_requests_own_on_the_engine(served: tuple[str, list[tuple[str, int | None]]]) -> None:
    url, budgets = served
    budgets.clear()
    for header in ("2", "4", "1"):
        r = complete(url, header)
        assert r.status_code == 200, r.text
        assert budgets[-1] == (r.json()["id"], int(header))
    n = len(budgets)
    assert complete(url, None).status_code == 200
    assert len(budgets) == n  # no header: no request budget (the tenant's applies)


@pytest.mark.parametrize("value", ["0", "5", "-1", "two", "", "1.5", "2,3"])
def test_anything_else_is_a_400_naming_the_header(served: tuple[str, list[tuple[str, int | None]]],
                                                   value: str) -> None:
    url, budgets = served
    n = len(budgets)
    r = complete(url, value)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_header", HEADER)
    assert f"Invalid {HEADER} header" in error["message"]
    assert len(budgets) == n


def test_parsing_and_the_models_bound() -> None:
    assert parse_expert_budget(None) is None and parse_expert_budget(" 3 ") == 3
    with pytest.raises(ValueError):
        parse_expert_budget("\u0663")  # a digit, but not an ASCII one
    with pytest.raises(ValueError, match=HEADER):
        parse_expert_budget("0")
    assert over_model(None, 0) is None and over_model(4, 4) is None and over_model(3, None) is None
    assert "no experts" in over_model(1, 0)  # type: ignore[operator]  # a dense model
    assert "4 experts" in over_model(5, 4)  # type: ignore[operator]
