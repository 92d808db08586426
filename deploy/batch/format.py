"""The batch files: OpenAI batch input lines, OpenAI batch output lines, and what an output file has done.

Mental model: the input is JSONL, one request a line, `{"custom_id", "method": "POST", "url", "body"}`.
It is validated whole before anything is sent, so a typo on line 9,000 fails in a second, not after
an hour; every problem is reported with its line number. The output is append-only JSONL written by
one runner, one line per finished request (success or error), flushed as it finishes; lines appear
in completion order, matched to the input by `custom_id`. A runner killed mid-write leaves at most
one torn last line (no trailing newline): `load_done` cuts it off (`repair=True`) so the file is
again a sequence of whole lines, and a resumed run skips every `custom_id` it found.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_URLS = ("/v1/chat/completions", "/v1/completions")
MAX_REPORTED_ERRORS = 20  # enough to fix a file in one pass without flooding the terminal


class BatchInputError(ValueError):
    """The input file is not a valid batch: `problems` holds (line number, message) pairs."""

    def __init__(self, path: str | Path, problems: list[tuple[int, str]]) -> None:
        self.path = str(path)
        self.problems = problems
        shown = [f"  line {n}: {msg}" for n, msg in problems[:MAX_REPORTED_ERRORS]]
        if len(problems) > MAX_REPORTED_ERRORS:
            shown.append(f"  ... and {len(problems) - MAX_REPORTED_ERRORS} more")
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"{self.path}: {len(problems)} {noun}; nothing was sent\n" + "\n".join(shown))


class BatchOutputError(ValueError):
    """The output file holds a whole line that is not a batch output line: appending to it would
    mix two kinds of file, so the run stops before sending anything."""


@dataclass(frozen=True)
class BatchLine:
    line_no: int  # 1-based, as editors show it
    custom_id: str
    url: str
    body: dict[str, Any]


def _check(obj: Any) -> str | None:
    """Why one parsed line is not a batch request, or None when it is."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "missing or empty 'custom_id' (a non-empty string)"
    if obj.get("method", "POST") != "POST":
        return f"unsupported method {obj.get('method')!r} (only 'POST')"
    if obj.get("url") not in SUPPORTED_URLS:
        return f"unsupported url {obj.get('url')!r} (one of {', '.join(SUPPORTED_URLS)})"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "missing 'body' (a JSON object: the request to send)"
    if body.get("stream"):
        return "'body.stream' must be false: batch results are whole responses"
    extra = set(obj) - {"custom_id", "method", "url", "body"}
    if extra:
        return f"unknown field(s) {sorted(extra)}"
    return None


def read_input(path: str | Path) -> list[BatchLine]:
    """All requests of a batch input file, or BatchInputError naming every bad line. Blank lines
    are skipped (a trailing newline, or a gap left by an editor), but still counted."""
    lines: list[BatchLine] = []
    problems: list[tuple[int, str]] = []
    first_seen: dict[str, int] = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BatchInputError(path, [(0, f"cannot read the file: {e}")]) from e
    for line_no, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            problems.append((line_no, f"bad JSON: {e.msg} (column {e.colno})"))
            continue
        why = _check(obj)
        if why is not None:
            problems.append((line_no, why))
            continue
        custom_id = obj["custom_id"]
        if custom_id in first_seen:
            problems.append((line_no, f"duplicate custom_id {custom_id!r} (first on line {first_seen[custom_id]})"))
            continue
        first_seen[custom_id] = line_no
        lines.append(BatchLine(line_no, custom_id, obj["url"], obj["body"]))
    if not lines and not problems:
        problems.append((0, "no requests (the file is empty)"))
    if problems:
        raise BatchInputError(path, problems)
    return lines


def response_line(custom_id: str, status_code: int, request_id: str | None, body: Any) -> dict[str, Any]:
    """The output line for a request that got an HTTP answer. Non-2xx answers carry `error` too
    (code and message taken from the OpenAI-style error body when there is one)."""
    error = None
    if not 200 <= status_code < 300:
        detail = body.get("error") if isinstance(body, dict) else None
        detail = detail if isinstance(detail, dict) else {}
        error = {"code": detail.get("code") or f"http_{status_code}",
                 "message": detail.get("message") or f"HTTP {status_code}"}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": error}


def error_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """The output line for a request that got no HTTP answer (a timeout, a broken response)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def encode_line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def load_done(path: str | Path, *, repair: bool) -> tuple[set[str], int]:
    """The custom_ids an output file already holds and the byte length of its whole lines. A torn
    last line (no newline) is ignored, and cut off when `repair` (the runner does this under its
    lock before appending; a reader that only watches passes False). A missing file is empty."""
    p = Path(path)
    if not p.exists():
        return set(), 0
    data = p.read_bytes()
    whole = data.rfind(b"\n") + 1  # bytes up to and including the last newline
    done: set[str] = set()
    for line_no, raw in enumerate(data[:whole].splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BatchOutputError(f"{p}: line {line_no} is not JSON ({e}); is this a batch output file?") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str):
            raise BatchOutputError(f"{p}: line {line_no} has no custom_id; is this a batch output file?")
        done.add(obj["custom_id"])
    if repair and whole < len(data):
        with open(p, "r+b") as f:
            f.truncate(whole)
            os.fsync(f.fileno())
    return done, whole
