"""A client that leaves aborts its request: the engine drops it and every KV block is free again.

Each request asks for ~4000 tokens. The tests poll until the engine is idle and the request's
timeline says how it ended, within a deadline only a hung engine reaches: what they prove does not
rest on timing. Two facts are checked then: the timeline says it ended as an abort, and the engine
itself computed well under half of what the full request would have (a request left to run out
ends as "length", having forwarded its prompt and all of its max_tokens).
"""

from __future__ import annotations

import json
import socket
import time

import httpx2 as httpx
import pytest

from tests.deploy.openai.conftest import MAX_MODEL_LEN, NUM_BLOCKS, SECRET, Served

AUTH = {"Authorization": "Bearer key-a"}
MAX_TOKENS = MAX_MODEL_LEN - 100  # leaves room for either prompt below
LONG = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
LONG_CHAT = {**{k: v for k, v in LONG.items() if k != "prompt"},
             "messages": [{"role": "user", "content": "Tell me about the ferry."}]}
DEADLINE_S = 120.0  # generous: a request left to run out finishes well before it, and fails the checks


def forwarded_tokens(served: Served) -> int:
    return served.backend.async_engine.stats().num_forwarded_tokens


def wait_until_idle(served: Served, request_id: str | None = None) -> None:
    """Polls until the engine holds no request and no block (cached blocks count as free), and the
    request's timeline (if given) has recorded how it ended."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        stats = served.backend.async_engine.stats()
        idle = (stats.num_running, stats.num_waiting, stats.num_blocks_free) == (0, 0, NUM_BLOCKS)
        timeline = served.backend.timeline(request_id) if request_id else None
        if idle and (request_id is None or (timeline is not None and timeline["status"] == "finished")):
            return
        assert time.monotonic() < deadline, f"request still in the engine after {DEADLINE_S:g}s: {stats}, {timeline}"
        time.sleep(0.01)


def assert_aborted_early(served: Served, request_id: str, forwarded_before: int) -> None:
    wait_until_idle(served, request_id)
    timeline = served.backend.timeline(request_id)
    assert timeline is not None and timeline["finish_reason"] == "abort"
    assert 1 <= timeline["num_output_tokens"] < MAX_TOKENS
    assert forwarded_tokens(served) - forwarded_before < MAX_TOKENS // 2


@pytest.mark.parametrize("path,body", [("/v1/completions", LONG), ("/v1/chat/completions", LONG_CHAT)])
def test_stream_disconnect_frees_blocks(served: Served, path: str, body: dict[str, object]) -> None:
    wait_until_idle(served)
    before = forwarded_tokens(served)
    with httpx.Client(base_url=served.base_url, timeout=30) as http:
        with http.stream("POST", path, json={**body, "stream": True}, headers=AUTH) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            request_id = r.headers["x-request-id"]
            events = []
            lines = r.iter_lines()  # held: dropping it would close the connection at once
            for line in lines:
                if line.startswith("data: "):
                    events.append(json.loads(line[len("data: "):]))
                if len(events) == 2:
                    break
            assert [e["id"] for e in events] == [request_id] * 2
            assert served.backend.async_engine.stats().num_running == 1  # still generating
        # Leaving the `with` closes the connection mid-stream.
    assert_aborted_early(served, request_id, before)


def test_non_stream_disconnect_frees_blocks(served: Served) -> None:
    wait_until_idle(served)
    before = forwarded_tokens(served)
    body = json.dumps(LONG).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer key-a\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    # A raw socket: the client leaves at a moment the test chooses, while the request is running.
    with socket.create_connection(("127.0.0.1", int(served.base_url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + DEADLINE_S
        # Until its first token has reached the ingress: a request cancelled before any output is
        # forgotten (no timeline), which is not what this test is about.
        while not streaming(served):
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    recent = served.backend.timelines.request_ids()[-1]  # no response ever carried its id
    assert recent.startswith("cmpl-")
    assert_aborted_early(served, recent, before)


def streaming(served: Served) -> bool:
    """Whether the newest request has a token out of the engine and in its timeline."""
    ids = served.backend.timelines.request_ids()
    timeline = served.backend.timeline(ids[-1]) if ids else None
    return timeline is not None and timeline["num_output_tokens"] >= 1 and timeline["status"] != "finished"


def test_error_mid_stream_is_sent_in_band_and_aborts(served: Served) -> None:
    wait_until_idle(served)
    before = forwarded_tokens(served)
    with httpx.Client(base_url=served.base_url, timeout=30) as http:
        r = http.post("/v1/completions", json={**LONG, "stream": True}, headers={"Authorization": "Bearer key-flaky"})
    assert r.status_code == 200  # the status line left with the first chunk
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line]
    *chunks, error, done = events
    assert len(chunks) >= 1 and all(json.loads(c)["object"] == "text_completion" for c in chunks)
    request_id = r.headers["x-request-id"]
    assert json.loads(error) == {"error": {
        "message": f"The server had an error processing your request (request id {request_id}).",
        "type": "server_error", "param": None, "code": "internal_error"}}
    assert done == "[DONE]" and SECRET not in r.text
    assert_aborted_early(served, request_id, before)
