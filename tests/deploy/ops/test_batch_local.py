"""`ferry batch submit --local` against the in-process app: output format, error lines, 429 retries,
resume without redoing a line, an unreachable server, and validation before anything is sent."""

from __future__ import annotations

import fcntl
import json
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from deploy.batch.format import BatchInputError, BatchOutputError
from tests.deploy.ops.conftest import CRASH_SEED, REFUSE_SEED, App, batch_request, ferry, read_jsonl, write_jsonl


def submit_local(app_url: str, inp: Path, out: Path, *extra: str) -> int:
    return ferry(["batch", "submit", str(inp), "--out", str(out), "--url", app_url, "--local", *extra])


def direct(app: App, line: dict[str, Any]) -> dict[str, Any]:
    """The same request sent straight to the server: what the batch output must hold."""
    req = urllib.request.Request(app.base_url + line["url"], data=json.dumps(line["body"]).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def test_batch_output_lines_and_error_lines(app: App, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = [batch_request(i) for i in range(6)]
    bad = [batch_request(6, model="nope"), batch_request(7, temperature=-1), batch_request(8, seed=CRASH_SEED)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", good + bad), tmp_path / "out.jsonl"
    assert submit_local(app.base_url, inp, out, "--concurrency", "3") == 0
    rows = {row["custom_id"]: row for row in read_jsonl(out)}
    assert sorted(rows) == sorted(f"req-{i}" for i in range(9)) and len(read_jsonl(out)) == 9
    assert len(app.recorder.seen) == 9
    assert {s.slo_class for s in app.recorder.seen} == {"batch"}
    for line in good:
        row = rows[line["custom_id"]]
        assert row["id"].startswith("batch_req_") and row["error"] is None
        resp = row["response"]
        assert resp["status_code"] == 200 and resp["request_id"] == resp["body"]["id"]
        want = direct(app, line)
        assert resp["body"]["object"] == want["object"]
        assert resp["body"]["choices"] == want["choices"]
        usage = ("prompt_tokens", "completion_tokens")  # cached_tokens differ: the direct call hits the cache
        assert [resp["body"]["usage"][k] for k in usage] == [want["usage"][k] for k in usage]
    assert rows["req-6"]["response"]["status_code"] == 404
    assert rows["req-6"]["error"]["code"] == "model_not_found"
    assert rows["req-7"]["response"]["status_code"] == 400 and "temperature" in rows["req-7"]["error"]["message"]
    assert rows["req-8"]["response"]["status_code"] == 500 and rows["req-8"]["error"] is not None
    err = capsys.readouterr().err
    assert "9/9 100%" in err and "9/9 lines done: 6 ok, 3 failed this run, 0 already in the output" in err


def test_429_waits_for_retry_after_then_succeeds(app: App, tmp_path: Path) -> None:
    app.backend.refusals[REFUSE_SEED] = 2
    inp, out = write_jsonl(tmp_path / "in.jsonl", [batch_request(0, seed=REFUSE_SEED)]), tmp_path / "out.jsonl"
    t0 = time.monotonic()
    assert submit_local(app.base_url, inp, out) == 0
    elapsed = time.monotonic() - t0
    [row] = read_jsonl(out)
    assert row["response"]["status_code"] == 200 and row["error"] is None
    assert app.backend.num_refused == 2 and len(app.recorder.seen) == 3
    assert elapsed >= 2.0  # Retry-After: 1 (s), twice


def test_429_after_max_retries_is_an_error_line(app: App, tmp_path: Path) -> None:
    app.backend.refusals[REFUSE_SEED] = 5
    inp, out = write_jsonl(tmp_path / "in.jsonl", [batch_request(0, seed=REFUSE_SEED)]), tmp_path / "out.jsonl"
    assert submit_local(app.base_url, inp, out, "--max-retries", "1") == 0
    [row] = read_jsonl(out)
    assert row["response"]["status_code"] == 429 and row["error"]["code"] == "scripted_refusal"
    assert len(app.recorder.seen) == 2


def test_resume_sends_only_the_rest(app: App, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [batch_request(i) for i in range(6)]
    first, inp, out = tmp_path / "first.jsonl", tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(first, lines[:3])
    write_jsonl(inp, lines)
    assert submit_local(app.base_url, first, out) == 0
    done_before = out.read_text()
    with open(out, "a") as f:  # a runner killed mid-write leaves a torn line
        f.write('{"id": "batch_req_torn", "custom_id": "req-3", "respo')
    app.recorder.seen.clear()
    assert submit_local(app.base_url, inp, out) == 0
    sent = sorted(json.dumps(s.body, sort_keys=True) for s in app.recorder.seen)
    assert sent == sorted(json.dumps(line["body"], sort_keys=True) for line in lines[3:])
    text = out.read_text()
    assert text.startswith(done_before) and "batch_req_torn" not in text
    ids = [row["custom_id"] for row in read_jsonl(out)]
    assert sorted(ids) == [f"req-{i}" for i in range(6)]
    assert "3 already in" in capsys.readouterr().err
    app.recorder.seen.clear()
    assert submit_local(app.base_url, inp, out) == 0  # all done: nothing is sent
    assert app.recorder.seen == [] and "nothing to do" in capsys.readouterr().err


def test_unreachable_server_writes_nothing_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp, out = write_jsonl(tmp_path / "in.jsonl", [batch_request(i) for i in range(3)]), tmp_path / "out.jsonl"
    assert submit_local(dead_url(), inp, out, "--max-retries", "1") == 1
    assert out.read_text() == ""
    err = capsys.readouterr().err
    assert "3 unfinished (server unreachable" in err and "submit again" in err


def test_bad_input_is_refused_before_sending(app: App, tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps(batch_request(0)) + "\n" + json.dumps(batch_request(0)) + "\n{oops\n")
    with pytest.raises(BatchInputError) as info:
        submit_local(app.base_url, inp, out)
    assert [n for n, _ in info.value.problems] == [2, 3]
    assert not out.exists() and app.recorder.seen == []


def test_one_writer_per_output_file(app: App, tmp_path: Path) -> None:
    inp, out = write_jsonl(tmp_path / "in.jsonl", [batch_request(0)]), tmp_path / "out.jsonl"
    with open(out, "a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another runner at work
        with pytest.raises(BatchOutputError, match="another batch runner"):
            submit_local(app.base_url, inp, out)
    assert app.recorder.seen == []


def test_slow_request_becomes_a_timeout_line(app: App, tmp_path: Path) -> None:
    app.backend.delay_s = 1.5
    inp, out = write_jsonl(tmp_path / "in.jsonl", [batch_request(0)]), tmp_path / "out.jsonl"
    assert submit_local(app.base_url, inp, out, "--timeout", "0.3") == 0
    [row] = read_jsonl(out)
    assert row["response"] is None and row["error"] == {"code": "timeout", "message": "no answer within 0.3 s"}
