"""Batch files without a server: input validation names every bad line, output repair and resume ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.batch.format import BatchInputError, BatchOutputError, load_done, read_input, response_line
from tests.deploy.ops.conftest import batch_request, write_jsonl


def test_valid_input_keeps_order_and_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps(batch_request(0)) + "\n\n" + json.dumps(batch_request(1)) + "\n")
    lines = read_input(path)
    assert [(ln.line_no, ln.custom_id, ln.url) for ln in lines] == [
        (1, "req-0", "/v1/chat/completions"), (3, "req-1", "/v1/completions")]
    assert lines[1].body == batch_request(1)["body"]


def test_every_bad_line_is_named(tmp_path: Path) -> None:
    good = batch_request(0)
    rows = [
        json.dumps(good),                                                   # 1 ok
        '{"custom_id": "x", "method": "POST", "url": "/v1/completions", ',  # 2 truncated JSON
        json.dumps({k: v for k, v in good.items() if k != "custom_id"}),    # 3 no custom_id
        json.dumps(good),                                                   # 4 duplicate of line 1
        json.dumps(good | {"custom_id": "e", "url": "/v1/embeddings"}),     # 5 unsupported url
        json.dumps(good | {"custom_id": "g", "method": "GET"}),             # 6 unsupported method
        json.dumps(good | {"custom_id": "b", "body": "hi"}),                # 7 body not an object
        json.dumps(good | {"custom_id": "s", "body": {"stream": True}}),    # 8 streaming
        "[1, 2]",                                                           # 9 not an object
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(BatchInputError) as info:
        read_input(path)
    assert [n for n, _ in info.value.problems] == [2, 3, 4, 5, 6, 7, 8, 9]
    msgs = dict(info.value.problems)
    assert msgs[2].startswith("bad JSON")
    assert "custom_id" in msgs[3]
    assert msgs[4] == "duplicate custom_id 'req-0' (first on line 1)"
    assert "'/v1/embeddings'" in msgs[5] and "'GET'" in msgs[6] and "body" in msgs[7] and "stream" in msgs[8]
    text = str(info.value)
    assert text.startswith(f"{path}: 8 problems; nothing was sent") and "  line 4: duplicate" in text


def test_empty_input_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(BatchInputError, match="no requests"):
        read_input(write_jsonl(tmp_path / "in.jsonl", []))


def test_load_done_ignores_and_repairs_a_torn_last_line(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    whole = "".join(json.dumps(response_line(f"req-{i}", 200, f"r{i}", {})) + "\n" for i in range(3))
    out.write_text(whole + '{"id": "batch_req_x", "custom_id": "req-3", "resp')
    assert load_done(out, repair=False) == ({"req-0", "req-1", "req-2"}, len(whole.encode()))
    assert out.read_text().endswith('"resp')  # a reader never changes the file
    assert load_done(out, repair=True) == ({"req-0", "req-1", "req-2"}, len(whole.encode()))
    assert out.read_text() == whole


def test_load_done_refuses_a_foreign_file(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a"}\nnot json\n')
    with pytest.raises(BatchOutputError, match="line 2 is not JSON"):
        load_done(out, repair=True)
    out.write_text('{"hello": 1}\n')
    with pytest.raises(BatchOutputError, match="line 1 has no custom_id"):
        load_done(out, repair=True)
    assert load_done(tmp_path / "missing.jsonl", repair=True) == (set(), 0)


def test_response_line_shapes() -> None:
    ok = response_line("a", 200, "chatcmpl-1", {"x": 1})
    assert ok["id"].startswith("batch_req_") and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "chatcmpl-1", "body": {"x": 1}}
    bad = response_line("b", 400, "req-2", {"error": {"message": "no such model", "code": "model_not_found"}})
    assert bad["error"] == {"code": "model_not_found", "message": "no such model"}
    assert response_line("c", 502, None, "oops")["error"] == {"code": "http_502", "message": "HTTP 502"}
