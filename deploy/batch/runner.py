"""The batch runner: sends a validated batch file to the ferry HTTP API and appends results to OUT.

Mental model: one process owns OUT (an exclusive `flock`, so two runners can never interleave
lines). It validates IN whole, repairs OUT's torn last line, skips every custom_id OUT already
holds, and lets `concurrency` workers pull the remaining lines in input order. Each request is
marked `x-ferry-slo-class: batch` so the scheduler can fill idle capacity with it and preempt it for
online traffic. A finished request is one flushed line, success or not: a 4xx/5xx answer becomes an
error line, never a crash. Two things are retried instead: a 429 (after its Retry-After, since the
server asked for exactly that) and a refused connection (with backoff). A server that stays
unreachable stops the run without writing those lines, so a resubmit finishes exactly the rest.

Run as `python -m deploy.batch.runner --in IN --out OUT --url URL` (the Ray job's entrypoint; the
API key comes from $FERRY_API_KEY so it never shows in a process list) or via `run_batch` in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import IO, Any

import aiohttp

from deploy.batch.format import (BatchLine, BatchOutputError, encode_line, error_line, load_done, read_input,
                                 response_line)

logger = logging.getLogger(__name__)

API_KEY_ENV = "FERRY_API_KEY"
SLO_CLASS_HEADER = "x-ferry-slo-class"
MAX_RETRY_AFTER_S = 600.0  # a server asking for more than this is treated as asking for this
CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RunnerConfig:
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    concurrency: int = 8
    max_retries: int = 8  # per line, for 429s and for refused connections, counted separately
    request_timeout_s: float = 600.0
    slo_class: str = "batch"

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request timeout must be > 0 s, got {self.request_timeout_s}")


@dataclass
class BatchReport:
    total: int  # requests in IN
    skipped: int = 0  # already in OUT when the run started
    succeeded: int = 0  # written this run with a 2xx answer
    failed: int = 0  # written this run as error lines
    unfinished: int = 0  # not written: the server was unreachable; a resubmit sends them
    stop_reason: str | None = None

    @property
    def done(self) -> int:
        return self.skipped + self.succeeded + self.failed

    def summary(self) -> str:
        text = (f"{self.done}/{self.total} lines done: {self.succeeded} ok, {self.failed} failed this run, "
                f"{self.skipped} already in the output")
        if self.unfinished:
            text += f"; {self.unfinished} unfinished ({self.stop_reason}); submit again to finish them"
        return text


class ServerUnreachable(Exception):
    """No connection to the API after every retry."""


def _retry_after_s(header: str | None, attempt: int) -> float:
    """Seconds to wait after a 429: the server's Retry-After (seconds or an HTTP date), else backoff.
    A little jitter keeps workers refused together from all coming back in the same instant."""
    wait = None
    if header:
        try:
            wait = float(header)
        except ValueError:
            try:
                wait = parsedate_to_datetime(header).timestamp() - time.time()
            except (TypeError, ValueError):
                wait = None
    if wait is None:
        wait = _backoff_s(attempt)
    return min(max(wait, 0.0), MAX_RETRY_AFTER_S) + random.uniform(0.0, 0.1)


def _backoff_s(attempt: int) -> float:
    return min(0.5 * 2 ** attempt, 10.0)


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {"error": {"code": "non_json_response", "message": raw[:500].decode("utf-8", "replace")}}


async def send_one(session: aiohttp.ClientSession, line: BatchLine, cfg: RunnerConfig) -> dict[str, Any]:
    """The output line of one request; raises ServerUnreachable when no connection is possible."""
    url = cfg.url.rstrip("/") + line.url
    headers = {SLO_CLASS_HEADER: cfg.slo_class}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    refusals = failures = 0
    while True:
        try:
            async with session.post(url, json=line.body, headers=headers) as resp:
                raw = await resp.read()
                retry_after = resp.headers.get("Retry-After")
            if resp.status == 429 and refusals < cfg.max_retries:
                refusals += 1  # the wait happens after the connection went back to the pool
                await asyncio.sleep(_retry_after_s(retry_after, refusals))
                continue
            return response_line(line.custom_id, resp.status, resp.headers.get("x-request-id"), _decode(raw))
        except aiohttp.ClientConnectionError as e:
            # Before TimeoutError: a connect timeout is both, and it means "no server", not "slow line".
            if isinstance(e, TimeoutError) and not isinstance(e, aiohttp.ConnectionTimeoutError):
                return error_line(line.custom_id, "timeout", f"no answer within {cfg.request_timeout_s:g} s")
            if failures >= cfg.max_retries:
                raise ServerUnreachable(f"{url}: {type(e).__name__}: {e}") from e
            failures += 1
            await asyncio.sleep(_backoff_s(failures))
        except TimeoutError:
            return error_line(line.custom_id, "timeout", f"no answer within {cfg.request_timeout_s:g} s")
        except aiohttp.ClientError as e:
            return error_line(line.custom_id, "client_error", f"{type(e).__name__}: {e}")


def _lock_output(path: Path) -> IO[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    out = open(path, "a", encoding="utf-8")
    try:
        fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        out.close()
        raise BatchOutputError(f"{path}: another batch runner is writing this file") from None
    return out


async def run_batch(in_path: str | Path, out_path: str | Path, cfg: RunnerConfig,
                    on_progress: Callable[[BatchReport], None] | None = None) -> BatchReport:
    """Runs the batch to the end (or until the server is unreachable) and reports what happened."""
    lines = read_input(in_path)  # all of IN is checked before OUT is touched
    out = _lock_output(Path(out_path))
    try:
        done, _ = load_done(out_path, repair=True)
        todo = [line for line in lines if line.custom_id not in done]
        report = BatchReport(total=len(lines), skipped=len(lines) - len(todo))
        if on_progress:
            on_progress(report)
        pending = iter(todo)  # shared by the workers; next() never interleaves on one event loop
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=cfg.concurrency)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

            async def worker() -> None:
                for line in pending:
                    if report.stop_reason is not None:
                        return
                    try:
                        result = await send_one(session, line, cfg)
                    except ServerUnreachable as e:
                        report.stop_reason = report.stop_reason or f"server unreachable: {e}"
                        return
                    out.write(encode_line(result))
                    out.flush()  # per line: a kill loses at most the requests in flight
                    if result["error"] is None:
                        report.succeeded += 1
                    else:
                        report.failed += 1
                    if on_progress:
                        on_progress(report)

            await asyncio.gather(*(worker() for _ in range(min(cfg.concurrency, len(todo)))))
        report.unfinished = len(todo) - report.succeeded - report.failed
        return report
    finally:
        out.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.batch.runner",
                                description=f"Run a batch file against the ferry API (key from ${API_KEY_ENV}).")
    p.add_argument("--in", dest="in_path", required=True)
    p.add_argument("--out", dest="out_path", required=True)
    p.add_argument("--url", default=RunnerConfig.url)
    p.add_argument("--concurrency", type=int, default=RunnerConfig.concurrency)
    p.add_argument("--max-retries", type=int, default=RunnerConfig.max_retries)
    p.add_argument("--timeout", type=float, default=RunnerConfig.request_timeout_s, help="seconds per request")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    last_log = 0.0

    def log_progress(report: BatchReport) -> None:
        nonlocal last_log  # the job log gets a line every few seconds, not one per request
        if time.monotonic() - last_log >= 5.0 or report.done == report.total:
            last_log = time.monotonic()
            print(f"ferry-batch: {report.done}/{report.total} done", flush=True)

    try:
        cfg = RunnerConfig(args.url, os.environ.get(API_KEY_ENV) or None, args.concurrency, args.max_retries,
                           args.timeout)
        report = asyncio.run(run_batch(args.in_path, args.out_path, cfg, log_progress))
    except ValueError as e:  # BatchInputError, BatchOutputError, bad settings
        print(f"ferry-batch: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"ferry-batch: {report.summary()}", flush=True)
    return 1 if report.unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
