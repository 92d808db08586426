"""Replay a workload against one OpenAI-compatible endpoint with streaming completions.

Mental model: one asyncio task per request, started at its arrival time (open loop: a slow server
does not slow the arrivals, as with real users), optionally capped by a concurrency semaphore.
Each task posts `/v1/completions` with `stream: true` and `stream_options.include_usage`, stamps
every SSE chunk that carries text, and takes the token count from the final usage chunk. The run
is bounded twice: by `max_requests` and by `duration_s` (no new sends after it; in-flight
requests get `grace_s` more, then are cancelled and count as failed). Only loopback hosts are
accepted: this harness must never load someone else's server.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx2

from bench.loadgen.metrics import ClientRecord
from bench.loadgen.prompts import prompt_text
from bench.loadgen.workload import BenchRequest

log = logging.getLogger(__name__)


class NotLoopback(ValueError):
    """The target URL resolves to an address outside 127.0.0.0/8 and ::1."""


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if not host:
        raise NotLoopback(f"no host in URL {url!r}")
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise NotLoopback(f"cannot resolve {host!r}: {e}") from None
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise NotLoopback(f"refusing non-loopback target {url} ({', '.join(sorted(addrs))})")


@dataclass(frozen=True, slots=True)
class ClientConfig:
    url: str  # base, e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str
    max_concurrency: int | None = None
    max_requests: int | None = None
    duration_s: float = 120.0
    grace_s: float = 30.0
    ignore_eos: bool = True  # so output lengths follow the trace, as vLLM's bench does
    api_key: str | None = None
    salt: int = 0

    @property
    def completions_url(self) -> str:
        base = self.url.rstrip("/")
        return (base if base.endswith("/v1") else base + "/v1") + "/completions"


def _request_id(values: list[str]) -> str | None:
    """The server's request id. Behind Ray Serve's proxy a ferry answer carries two: Serve's own
    and the app's (`cmpl-...`), which its timelines are keyed by."""
    ours = [v for v in values if v.startswith(("cmpl-", "chatcmpl-"))]
    return (ours or values or [None])[0]


def _error_code(body: bytes) -> str | None:
    """`error.code` of an OpenAI-style error body (ferry: `{"error": {"code": "slo_unattainable", ...}}`),
    else None."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = err.get("code") if isinstance(err, dict) else None
    return str(code) if code else None


async def _one(client: httpx2.AsyncClient, cfg: ClientConfig, req: BenchRequest, index: int,
               rec: ClientRecord) -> None:
    body = {"model": cfg.model, "prompt": prompt_text(req, index, cfg.salt), "max_tokens": req.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    headers = {"x-ferry-slo-class": req.slo_class}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    # As vLLM: the clock starts once a client slot is free, so TTFT is the server's, not our cap's.
    rec.send_s = time.perf_counter()
    async with client.stream("POST", cfg.completions_url, json=body, headers=headers) as resp:
        rec.request_id = _request_id(resp.headers.get_list("x-request-id"))
        rec.status = resp.status_code
        if resp.status_code != 200:
            body = await resp.aread()
            rec.error = f"HTTP {resp.status_code}: {body[:200]!r}"
            rec.error_code = _error_code(body)
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter()
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                rec.chunk_s.append(now)
            if usage := chunk.get("usage"):
                rec.output_tokens = usage.get("completion_tokens")
                rec.prompt_tokens = usage.get("prompt_tokens")
    rec.success = bool(rec.chunk_s)
    if not rec.success:
        rec.error = "no text chunk"


async def replay(cfg: ClientConfig, workload: list[BenchRequest]) -> tuple[list[ClientRecord], float]:
    """Run the workload; returns (records of every request sent, duration in s)."""
    check_loopback(cfg.url)
    reqs = workload[: cfg.max_requests] if cfg.max_requests else workload
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    records: list[ClientRecord] = []
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx2.Timeout(cfg.duration_s + cfg.grace_s, connect=10.0)
    async with httpx2.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:

        async def run(i: int, req: BenchRequest, rec: ClientRecord) -> None:
            try:
                if sem is None:
                    await _one(client, cfg, req, i, rec)
                else:
                    async with sem:
                        await _one(client, cfg, req, i, rec)
            except asyncio.CancelledError:
                rec.error, rec.cancelled = "cancelled at the time bound", True
            except (httpx2.HTTPError, json.JSONDecodeError, OSError) as e:
                rec.error = f"{type(e).__name__}: {e}"

        start = time.perf_counter()
        tasks: list[asyncio.Task[None]] = []
        for i, req in enumerate(reqs):
            delay = start + req.arrival_s - time.perf_counter()
            if req.arrival_s > cfg.duration_s:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            rec = ClientRecord(send_s=time.perf_counter(), tenant=req.tenant, slo_class=req.slo_class)
            records.append(rec)
            tasks.append(asyncio.create_task(run(i, req, rec)))
        left = max(0.0, start + cfg.duration_s + cfg.grace_s - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=left) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        # vLLM's duration: from the first send to the end of the last request.
        end = max((r.chunk_s[-1] for r in records if r.chunk_s), default=time.perf_counter())
    failed = [r.error for r in records if not r.success]
    if failed:
        log.warning("%d of %d requests failed; first: %s", len(failed), len(records), failed[0])
    return records, max(end - start, 1e-9)
