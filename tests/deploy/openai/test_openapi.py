"""`/openapi.json` documents exactly the bodies the server accepts; `/v1/models`, `/health` and the
timeline endpoint answer as documented."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest

from deploy.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.deploy.openai.conftest import MAX_MODEL_LEN, NUM_BLOCKS, Served

AUTH = {"Authorization": "Bearer key-a"}
SHARED = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "seed", "stop", "stream", "stream_options", "n", "user", "ignore_eos", "min_tokens"}
COMPLETION_FIELDS = SHARED | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = SHARED | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.base_url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def spec(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/openapi.json")  # public: no key needed to read the docs
    assert r.status_code == 200
    return r.json()


def schema_of(spec: dict[str, Any], ref: str) -> dict[str, Any]:
    assert ref.startswith("#/components/schemas/")
    return spec["components"]["schemas"][ref.rsplit("/", 1)[1]]


@pytest.mark.parametrize("path,model,fields,required", [
    ("/v1/completions", CompletionRequest, COMPLETION_FIELDS, ["model", "prompt"]),
    ("/v1/chat/completions", ChatCompletionRequest, CHAT_FIELDS, ["model", "messages"]),
])
def test_request_schema_is_what_the_server_accepts(spec: dict[str, Any], path: str, model: type, fields: set[str],
                                                   required: list[str]) -> None:
    operation = spec["paths"][path]["post"]
    body = operation["requestBody"]
    assert body["required"] is True
    schema = schema_of(spec, body["content"]["application/json"]["schema"]["$ref"])
    assert set(schema["properties"]) == fields == set(model.model_fields)
    assert schema["additionalProperties"] is False and sorted(schema["required"]) == sorted(required)
    assert set(operation["responses"]) == {"200", "400", "401", "404", "413", "429", "500"}  # no 422: we send 400
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert operation["security"] == [{"HTTPBearer": []}]


def test_nested_schemas_and_no_stale_validation_models(spec: dict[str, Any]) -> None:
    schemas = spec["components"]["schemas"]
    assert set(schemas["ChatMessage"]["properties"]) == {"role", "content", "name"}
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant"]
    assert schemas["StreamOptions"]["additionalProperties"] is False
    assert {"ChatCompletionChunk", "ErrorResponse", "Usage"} <= set(schemas)
    assert not {"HTTPValidationError", "ValidationError"} & set(schemas)
    assert set(spec["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                  "/v1/requests/{request_id}/timeline", "/health"}


def test_undocumented_field_is_refused(http: httpx.Client, spec: dict[str, Any]) -> None:
    documented = set(schema_of(spec, spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
                               ["application/json"]["schema"]["$ref"])["properties"])
    assert "best_of" not in documented
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "best_of": 2}, headers=AUTH)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "best_of")


def test_models(http: httpx.Client, served: Served) -> None:
    r = http.get("/v1/models", headers=AUTH)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["max_model_len"]) for m in body["data"]] == [
        ("tiny", "model", "ferry", MAX_MODEL_LEN), ("tiny-alias", "model", "ferry", MAX_MODEL_LEN)]


def test_health(http: httpx.Client) -> None:
    r = http.get("/health")  # public: load balancers carry no key
    assert r.status_code == 200
    body = r.json()
    assert body.pop("rss_mib") > 10  # the engine runs in the server's process
    plan = body.pop("kv_plan")  # how the engine's KV pool was sized
    assert (plan["source"], plan["device"], plan["num_blocks"]) == ("num_blocks", "cpu", NUM_BLOCKS)
    assert body.pop("speculation") == {"method": "off", "draft_tokens": 0, "accepted_tokens": 0, "spec_rounds": 0,
                                       "acceptance_rate": None}
    assert body == {"healthy": True, "model": "tiny", "engine_loop": "running", "num_running": 0,
                        "num_waiting": 0, "num_blocks_total": NUM_BLOCKS, "num_blocks_free": NUM_BLOCKS}
    assert r.headers["x-request-id"].startswith("req-")


def test_timeline_of_own_request_only(http: httpx.Client) -> None:
    r = http.post("/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                                                         "temperature": 0, "ignore_eos": True})
    request_id = r.headers["x-request-id"]
    assert request_id == r.json()["id"]
    t = http.get(f"/v1/requests/{request_id}/timeline", headers=AUTH)
    assert t.status_code == 200
    timeline = t.json()
    assert (timeline["request_id"], timeline["tenant"], timeline["status"], timeline["finish_reason"]) == (
        request_id, "tenant-a", "finished", "length")
    assert (timeline["num_prompt_tokens"], timeline["num_output_tokens"]) == (3, 4)
    times = timeline["token_times_ms"]
    assert len(times) == 4 and times == sorted(times) and times[0] == timeline["ttft_ms"] > 0
    assert timeline["itl_ms"] == pytest.approx([b - a for a, b in zip(times, times[1:])], abs=1e-2)
    assert [s["stage"] for s in timeline["stages"]] == ["prefill", "decode"]
    assert timeline["e2e_ms"] == times[-1]

    not_found = {"error": {"message": f"No timeline for request '{request_id}'.", "type": "invalid_request_error",
                           "param": "request_id", "code": "request_not_found"}}
    other = http.get(f"/v1/requests/{request_id}/timeline", headers={"Authorization": "Bearer key-b"})
    assert (other.status_code, other.json()) == (404, not_found)  # another tenant's request: as if unknown
    missing = http.get("/v1/requests/cmpl-nope/timeline", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"
