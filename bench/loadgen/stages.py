"""Where a request's time went, from ferry's own per-request timelines, beside what the client saw.

Mental model: after each rate, the harness asks a ferry server for the timeline of every request
it answered (`GET /v1/requests/{id}/timeline`, the id from the `x-request-id` header). A timeline
has the prefill worker's stages (queued from the ingress's arrival to the prefill's start, pool
lookup, compute, KV transfer; absent for a prefill the decode worker ran itself) and the time the
engine produced each output token. `summarize_stages` turns them into one row per rate:
- TTFT split: queued / lookup / compute / transfer medians, and the first token as the engine made
  it vs as the client got it (their difference is the way out: decode worker, Ray, ingress, SSE);
- the prefill worker's busy fraction over the rate (the union of its compute intervals) and the
  prompt tokens/s it computed while busy: low busy time means prefill waits on something else,
  a low rate while busy means the steps themselves are slow (contention, small chunks);
- TPOT as the engine produced tokens vs as the client received them (the per-token path cost);
- prefix reuse: prompt tokens served from a prefix cache rather than computed (every request:
  a handed-off prompt's from its prefill worker's count, since the decode engine that reports
  `num_cached_tokens` received that KV and reused none itself; the others' `num_cached_tokens`),
  and for handed-off prompts the blocks found in the prefill worker's own cache vs fetched from
  the shared pool; bench/loadgen/prefix_tiers.py adds the split by tier.
Servers without timelines (peers) give no row.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx2
import numpy as np

from bench.loadgen.metrics import ClientRecord

FETCH_CONCURRENCY = 8


async def _fetch(base: str, ids: list[str], api_key: str | None) -> dict[str, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(FETCH_CONCURRENCY)
    found: dict[str, dict[str, Any]] = {}
    async with httpx2.AsyncClient(timeout=10.0, trust_env=False) as client:

        async def one(rid: str) -> None:
            async with sem:
                try:
                    resp = await client.get(f"{base}/v1/requests/{rid}/timeline", headers=headers)
                except httpx2.HTTPError:
                    return
                if resp.status_code == 200:
                    found[rid] = resp.json()

        await asyncio.gather(*(one(rid) for rid in ids))
    return found


def fetch_timelines(url: str, records: list[ClientRecord], api_key: str | None = None) -> dict[str, dict[str, Any]]:
    """Timelines of the answered requests, by request id; {} from a server that keeps none."""
    base = url.rstrip("/").removesuffix("/v1")
    ids = [r.request_id for r in records if r.success and r.request_id]
    return asyncio.run(_fetch(base, ids, api_key)) if ids else {}


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _p90(values: list[float]) -> float | None:
    return float(np.percentile(values, 90)) if values else None


def _union_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _reused_tokens(timeline: dict[str, Any]) -> int:
    """Prompt tokens of one request served from a prefix cache rather than computed."""
    prefill = timeline.get("prefill")
    if prefill and "computed_tokens" in prefill:
        return max(0, int(timeline["num_prompt_tokens"]) - int(prefill["computed_tokens"]))
    return int(timeline.get("num_cached_tokens") or 0)


def summarize_stages(records: list[ClientRecord], timelines: dict[str, dict[str, Any]],
                     duration_s: float) -> dict[str, Any] | None:
    """One rate's stage figures (milliseconds unless named), or None without timelines."""
    pairs = [(r, timelines[r.request_id]) for r in records if r.request_id in timelines]
    if not pairs:
        return None
    prefills = [t["prefill"] for _, t in pairs if t.get("prefill")]
    compute = [(p["finished_at"] - p["transfer_s"] - p["compute_s"], p["finished_at"] - p["transfer_s"])
               for p in prefills if "finished_at" in p]
    busy_s = _union_s(compute)
    computed = sum(p["computed_tokens"] for p in prefills)
    engine_tpot = [t["tpot_ms"] for _, t in pairs if t.get("tpot_ms") is not None]
    client_tpot = [r.tpot_s * 1e3 for r, t in pairs if r.num_output > 1 and t.get("tpot_ms") is not None]

    def ms(key: str) -> list[float]:
        return [p[key] * 1e3 for p in prefills]

    out = {
        "num_requests": len(pairs),
        "num_handed_off": len(prefills),
        "mean_prompt_tokens": float(np.mean([t["num_prompt_tokens"] for _, t in pairs])),
        "queued_p50_ms": _median(ms("queued_s")), "queued_p90_ms": _p90(ms("queued_s")),
        "lookup_p50_ms": _median(ms("lookup_s")),
        "compute_p50_ms": _median(ms("compute_s")), "compute_p90_ms": _p90(ms("compute_s")),
        "transfer_p50_ms": _median(ms("transfer_s")),
        "engine_ttft_p50_ms": _median([t["ttft_ms"] for _, t in pairs if t.get("ttft_ms") is not None]),
        "client_ttft_p50_ms": _median([r.ttft_s * 1e3 for r, _ in pairs]),
        "prefill_busy": busy_s / duration_s if duration_s > 0 and compute else None,
        "prefill_tok_s_busy": computed / busy_s if busy_s > 0 else None,
        "engine_tpot_p50_ms": _median(engine_tpot), "client_tpot_p50_ms": _median(client_tpot),
        "prefix_hit_tokens": sum(_reused_tokens(t) for _, t in pairs),
        "local_hit_blocks": sum(int(p.get("local_hit_blocks", 0)) for p in prefills),
        "pool_hit_blocks": sum(int(p.get("pool_hit_blocks", 0)) for p in prefills),
        "engine_tpot_mean_ms": float(np.mean(engine_tpot)) if engine_tpot else None,
        "client_tpot_mean_ms": float(np.mean(client_tpot)) if client_tpot else None,
    }
    e, c = out["engine_tpot_mean_ms"], out["client_tpot_mean_ms"]
    out["tpot_path_ratio"] = c / e if e and c else None
    return out


STAGE_COLUMNS = [
    ("rate rps", None), ("answered", "num_requests"), ("handed off", "num_handed_off"),
    ("prompt tok", "mean_prompt_tokens"), ("queued p50", "queued_p50_ms"), ("queued p90", "queued_p90_ms"),
    ("compute p50", "compute_p50_ms"), ("transfer p50", "transfer_p50_ms"),
    ("TTFT engine p50", "engine_ttft_p50_ms"), ("TTFT client p50", "client_ttft_p50_ms"),
    ("prefill busy", "prefill_busy"), ("prefill tok/s busy", "prefill_tok_s_busy"),
    ("TPOT engine", "engine_tpot_mean_ms"), ("TPOT client", "client_tpot_mean_ms"), ("client/engine", "tpot_path_ratio"),
    # prefix reuse (bench/loadgen/prefix_tiers.py): reused in all, from the engines' own caches, imported from
    # the pool by prefill workers; what the pool's stores served from each tier (store side, all callers)
    ("prefix hit tok", "prefix_hit_tokens"), ("own-cache tok", "local_hit_tokens"), ("pool tok", "pool_hit_tokens"),
    ("pool DRAM tok", "pool_dram_tokens"), ("pool disk tok", "pool_disk_tokens"),
]


def stage_row(rate: float, stages: dict[str, Any]) -> list[Any]:
    row: list[Any] = [rate]
    for _, key in STAGE_COLUMNS[1:]:
        v = stages.get(key)
        row.append(None if v is None else round(v, 2) if isinstance(v, float) and v < 10 else
                   round(v) if isinstance(v, float) else v)
    return row
