"""Every bad input gets its exact status and OpenAI-style error body, and the server keeps serving.

Raw httpx, not the openai client: these bodies are ones a client library would refuse to build.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest

from actors.errors import Refused
from deploy.openai.errors import to_api_error
from tests.deploy.openai.conftest import MAX_BODY_BYTES, MAX_MODEL_LEN, SECRET, Served

AUTH = {"Authorization": "Bearer key-a"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "The ferry", "max_tokens": 2}
CONTEXT_MSG = (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested {{}}. "
               "Please reduce the length of the {} or completion.")


def err(message: str, param: str | None, code: str | None, type: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(param: str, message: str) -> dict[str, Any]:
    return err(f"Invalid value for '{param}': {message}", param, "invalid_value")


def wrong_type(param: str, message: str) -> dict[str, Any]:
    return err(f"Invalid type for '{param}': {message}.", param, "invalid_type")


def with_(base: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**base, **fields}


# (id, path, json body, status, error body)
BAD_BODIES: list[tuple[str, str, Any, int, dict[str, Any]]] = [
    ("wrong-type-temperature", "/v1/completions", with_(COMPLETION, temperature="hot"), 400,
     wrong_type("temperature", "Input should be a valid number")),
    ("wrong-type-max-tokens", "/v1/completions", with_(COMPLETION, max_tokens=1.5), 400,
     wrong_type("max_tokens", "Input should be a valid integer")),
    ("wrong-type-prompt", "/v1/completions", with_(COMPLETION, prompt=5), 400,
     wrong_type("prompt", "Input should be a valid string; or Input should be a valid list")),
    ("wrong-type-content", "/v1/chat/completions",
     with_(CHAT, messages=[{"role": "user", "content": 5}]), 400,
     wrong_type("messages.0.content", "Input should be a valid string; or Input should be a valid list")),
    ("bad-role", "/v1/chat/completions", with_(CHAT, messages=[{"role": "tool", "content": "x"}]), 400,
     wrong_type("messages.0.role", "Input should be 'system', 'developer', 'user' or 'assistant'")),
    ("body-not-object", "/v1/completions", [1, 2], 400,
     err("The request body must be a JSON object.", None, "invalid_body")),
    ("unknown-field", "/v1/completions", with_(COMPLETION, logit_bias={"5": 1}), 400,
     err("Unrecognized request argument supplied: logit_bias", "logit_bias", "unrecognized_argument")),
    ("unknown-message-field", "/v1/chat/completions",
     with_(CHAT, messages=[{"role": "user", "content": "x", "tool_calls": []}]), 400,
     err("Unrecognized request argument supplied: messages.0.tool_calls", "messages.0.tool_calls",
         "unrecognized_argument")),
    ("missing-model", "/v1/chat/completions", {"messages": CHAT["messages"]}, 400,
     err("Missing required parameter: 'model'.", "model", "missing_required_parameter")),
    ("unknown-model", "/v1/chat/completions", with_(CHAT, model="gpt-4o"), 404,
     err("The model 'gpt-4o' does not exist or you do not have access to it.", "model", "model_not_found")),
    ("bad-temperature", "/v1/completions", with_(COMPLETION, temperature=-0.5), 400,
     invalid("temperature", "temperature must be in [0.0, 100.0], got -0.5")),
    ("bad-top-p", "/v1/chat/completions", with_(CHAT, top_p=0), 400,
     invalid("top_p", "top_p must be in (0.0, 1.0], got 0.0")),
    ("zero-max-tokens", "/v1/chat/completions", with_(CHAT, max_completion_tokens=0), 400,
     invalid("max_completion_tokens", "max_tokens must be in [1, inf], got 0")),
    ("top-logprobs-over-20", "/v1/chat/completions", with_(CHAT, logprobs=True, top_logprobs=21), 400,
     invalid("top_logprobs", "logprobs must be in [0, 20], got 21")),
    ("top-logprobs-alone", "/v1/chat/completions", with_(CHAT, top_logprobs=2), 400,
     err("top_logprobs needs logprobs set to true.", "top_logprobs", "invalid_value")),
    ("n-2", "/v1/completions", with_(COMPLETION, n=2), 400,
     invalid("n", "ferry returns one choice per request, got 2.")),
    ("echo", "/v1/completions", with_(COMPLETION, echo=True), 400, invalid("echo", "only false is supported.")),
    ("two-prompts", "/v1/completions", with_(COMPLETION, prompt=["a", "b"]), 400,
     invalid("prompt", "ferry serves one prompt per request, got 2.")),
    ("stream-options-without-stream", "/v1/completions",
     with_(COMPLETION, stream_options={"include_usage": True}), 400,
     err("stream_options is only allowed when stream is true.", "stream_options", "invalid_value")),
    ("empty-prompt", "/v1/completions", with_(COMPLETION, prompt=""), 400,
     err("The prompt is empty.", "prompt", "invalid_value")),
    ("token-out-of-vocab", "/v1/completions", with_(COMPLETION, prompt=[1, 99999]), 400,
     err("token ids [99999] are outside the vocabulary [0, 512)", "prompt", "invalid_value")),
    ("prompt-over-context", "/v1/completions", with_(COMPLETION, prompt=[7] * (MAX_MODEL_LEN + 4), max_tokens=None),
     400, err(CONTEXT_MSG.format(f"{MAX_MODEL_LEN + 4} tokens in the prompt and at least 1 to generate", "prompt"),
              "prompt", "context_length_exceeded")),
    ("prompt-plus-max-tokens-over-context", "/v1/completions",
     with_(COMPLETION, prompt=[7] * 10, max_tokens=MAX_MODEL_LEN - 4), 400,
     err(CONTEXT_MSG.format(f"{MAX_MODEL_LEN + 6} tokens (10 in the prompt, {MAX_MODEL_LEN - 4} in the completion)",
                            "prompt"), "max_tokens", "context_length_exceeded")),
    ("chat-over-context-streaming", "/v1/chat/completions",
     with_(CHAT, messages=[{"role": "user", "content": "ferry " * (MAX_MODEL_LEN // 2)}], stream=True), 400,
     err(CONTEXT_MSG.format("{} tokens ({} in the messages, 2 in the completion)", "messages"), "messages",
         "context_length_exceeded")),
]


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.base_url, timeout=30) as c:
        yield c


def assert_still_serves(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=COMPLETION, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def assert_error(r: httpx.Response, status: int, body: dict[str, Any]) -> None:
    assert (r.status_code, r.json()) == (status, body)
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-request-id"]


@pytest.mark.parametrize("path,body,status,expected", [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_bad_body(http: httpx.Client, served: Served, path: str, body: Any, status: int,
                  expected: dict[str, Any]) -> None:
    if "{}" in expected["error"]["message"]:  # the chat prompt's token count, known only once rendered
        ids = served.engine.encode_chat(body["messages"])
        message = expected["error"]["message"].format(len(ids) + 2, len(ids))
        expected = err(message, "messages", "context_length_exceeded")
    assert_error(http.post(path, json=body, headers=AUTH), status, expected)
    assert_still_serves(http)


def test_malformed_json(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [', headers=AUTH)
    message = ("We could not parse the JSON body of your request (Expecting value). "
               "Send a JSON object with Content-Type: application/json.")
    assert_error(r, 400, err(message, None, "invalid_json"))
    assert_still_serves(http)


def test_json_whatever_the_content_type(http: httpx.Client) -> None:
    # curl -d sends application/x-www-form-urlencoded; the body is still read as JSON.
    r = http.post("/v1/completions", content=json.dumps(COMPLETION).encode(),
                  headers={**AUTH, "content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_body_over_limit_by_header_and_by_bytes(http: httpx.Client) -> None:
    big = json.dumps(with_(COMPLETION, prompt="x" * MAX_BODY_BYTES)).encode()
    r = http.post("/v1/completions", content=big, headers={**AUTH, "content-type": "application/json"})
    assert_error(r, 413, err(f"Request body is {len(big)} bytes; this server accepts at most {MAX_BODY_BYTES} bytes.",
                             None, "request_too_large"))
    # Chunked upload: no Content-Length to trust, so the bytes themselves are counted.
    r = http.post("/v1/completions", content=iter([big[:10_000], big[10_000:]]),
                  headers={**AUTH, "content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, err(f"Request body is more than {MAX_BODY_BYTES} bytes; this server accepts at most "
                             f"{MAX_BODY_BYTES} bytes.", None, "request_too_large"))
    assert_still_serves(http)


@pytest.mark.parametrize("headers,expected", [
    ({}, err("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.", None, "missing_api_key",
             "authentication_error")),
    ({"Authorization": "Bearer sk-wrong-key-123"},
     err("Incorrect API key provided: sk-...23.", None, "invalid_api_key", "authentication_error")),
    ({"Authorization": "Basic key-a"},  # a valid key under the wrong scheme is no key
     err("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.", None, "missing_api_key",
         "authentication_error")),
], ids=["missing", "wrong", "not-bearer"])
@pytest.mark.parametrize("method,path", [("POST", "/v1/chat/completions"), ("GET", "/v1/models")])
def test_auth(http: httpx.Client, headers: dict[str, str], expected: dict[str, Any], method: str, path: str) -> None:
    # The key is checked before the body is even read: a malformed body still gets 401.
    r = http.request(method, path, content=b"{not json" if method == "POST" else None, headers=headers)
    assert_error(r, 401, expected)
    assert r.headers["www-authenticate"] == "Bearer"
    assert_still_serves(http)


@pytest.mark.parametrize("stream", [False, True])
def test_refusal_is_429_with_retry_after(http: httpx.Client, stream: bool) -> None:
    throttled = {"Authorization": "Bearer key-throttled"}
    r = http.post("/v1/chat/completions", json=with_(CHAT, stream=stream), headers=throttled)
    want = err("Request refused: tenant_over_budget. Retry after 3 s.", None, "tenant_over_budget", "rate_limit_error")
    want["error"]["retry_after_s"] = 2.5
    assert_error(r, 429, want)
    assert r.headers["retry-after"] == "3"
    assert_still_serves(http)


def test_a_refusal_says_why_and_the_predicted_wait() -> None:
    api = to_api_error(Refused("slo_unattainable", "predicted TTFT 4200 ms (after 3000 ms queued) > target "
                                                "3000 ms", retry_after_s=1.2, predicted_wait_s=3.0), prompt_param="prompt")
    assert api is not None and api.status == 429 and api.headers == {"Retry-After": "2"}
    assert api.body() == {"error": {
        "message": "Request refused: slo_unattainable: predicted TTFT 4200 ms (after 3000 ms queued) > target 3000 ms. "
                   "Retry after 2 s.",
        "type": "rate_limit_error", "param": None, "code": "slo_unattainable", "retry_after_s": 1.2,
        "predicted_wait_s": 3.0}}


def test_internal_error_is_500_without_details(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer key-broken"})
    request_id = r.headers["x-request-id"]
    assert request_id.startswith("cmpl-")
    assert_error(r, 500, err(f"The server had an error processing your request (request id {request_id}).",
                             None, "internal_error", "server_error"))
    assert SECRET not in r.text and "Traceback" not in r.text
    assert_still_serves(http)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v2/nothing", headers=AUTH), 404, err("GET /v2/nothing: Not Found", None, "not_found"))
    assert_error(http.get("/v1/completions", headers=AUTH), 405,
                 err("GET /v1/completions: Method Not Allowed", None, "method_not_allowed"))
    assert_still_serves(http)
