"""Requests to replay: trace parsing (Azure 2023 conversation CSV, Mooncake JSONL) and scaling.

Mental model: a trace is a list of (arrival, prompt length, output length, prefix block ids).
Time scaling multiplies every arrival by one factor (so burstiness keeps its shape); `rescale_rate`
picks that factor so the mean rate is R. Length scaling multiplies every length by one factor and
then clips to the model's context, so the length distribution keeps its shape below the clip.
Mooncake's block size shrinks with the same factor, keeping the prefix structure of `hash_ids`.
Traces are read in place from shared/traces, never copied into the repo.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
TRACE_DIR = Path(__file__).resolve().parents[3] / "shared" / "traces"
KNOWN_TRACES = {"azure": "azure_llm_2023_conv.csv", "mooncake": "mooncake_synthetic_trace.jsonl"}


@dataclass(frozen=True, slots=True)
class BenchRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # Mooncake prefix blocks; equal ids = equal prompt prefix
    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per hash id after length scaling
    tenant: str = "default"
    slo_class: str = "default"


def resolve_trace(name_or_path: str) -> Path:
    """`azure`, `mooncake`, or a path to a .csv/.jsonl file."""
    path = TRACE_DIR / KNOWN_TRACES[name_or_path] if name_or_path in KNOWN_TRACES else Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"trace not found: {path}")
    return path


def load_trace(path: Path, limit: int | None = None) -> list[BenchRequest]:
    """Parse by suffix; arrivals start at 0 and are sorted (the CSV is, JSONL ties keep file order)."""
    if path.suffix == ".csv":
        return load_azure(path, limit)
    if path.suffix in (".jsonl", ".json"):
        return load_mooncake(path, limit)
    raise ValueError(f"unknown trace format (want .csv or .jsonl): {path}")


def load_azure(path: Path, limit: int | None = None) -> list[BenchRequest]:
    out: list[BenchRequest] = []
    t0: datetime | None = None
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            # Timestamps carry 7 fractional digits; datetime takes at most 6.
            stamp = row["TIMESTAMP"].strip()
            head, _, frac = stamp.partition(".")
            ts = datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")
            t0 = t0 or ts
            out.append(BenchRequest(arrival_s=(ts - t0).total_seconds(), prompt_len=int(row["ContextTokens"]),
                                    output_len=int(row["GeneratedTokens"])))
            if limit is not None and len(out) >= limit:
                break
    return out


def load_mooncake(path: Path, limit: int | None = None) -> list[BenchRequest]:
    out: list[BenchRequest] = []
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            out.append(BenchRequest(arrival_s=float(rec["timestamp"]) / 1000.0, prompt_len=int(rec["input_length"]),
                                    output_len=int(rec["output_length"]), hash_ids=tuple(rec.get("hash_ids", ()))))
            if limit is not None and len(out) >= limit:
                break
    t0 = min((r.arrival_s for r in out), default=0.0)
    return sorted((replace(r, arrival_s=r.arrival_s - t0) for r in out), key=lambda r: r.arrival_s)


def scale_time(reqs: list[BenchRequest], factor: float) -> list[BenchRequest]:
    """factor < 1 compresses (faster replay); the shape of the inter-arrival gaps is unchanged."""
    assert factor > 0
    return [replace(r, arrival_s=r.arrival_s * factor) for r in reqs]


def rescale_rate(reqs: list[BenchRequest], rate_rps: float) -> list[BenchRequest]:
    """Time-scale so the mean rate over the trace's span is `rate_rps` (n - 1 gaps over the span)."""
    if len(reqs) < 2:
        return list(reqs)
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    if span <= 0:
        return list(reqs)
    return scale_time(reqs, (len(reqs) - 1) / rate_rps / span)


def scale_lengths(reqs: list[BenchRequest], factor: float, max_model_len: int,
                  max_output_len: int | None = None, max_prompt_len: int | None = None) -> list[BenchRequest]:
    """Multiply lengths by `factor` (>= 1 token each), then clip: the output to `max_output_len`,
    the prompt to `max_prompt_len`, and both together to the context `max_model_len`."""
    assert factor > 0 and max_model_len >= 2
    block = max(1, round(MOONCAKE_BLOCK_TOKENS * factor))
    out = []
    for r in reqs:
        out_len = max(1, round(r.output_len * factor))
        if max_output_len is not None:
            out_len = min(out_len, max_output_len)
        out_len = min(out_len, max_model_len - 1)
        prompt = min(max(1, round(r.prompt_len * factor)), max_model_len - out_len, max_prompt_len or max_model_len)
        # Keep only the hash ids whose blocks still start inside the clipped prompt.
        ids = r.hash_ids[: -(-prompt // block)] if r.hash_ids else ()
        out.append(replace(r, prompt_len=prompt, output_len=out_len, hash_ids=ids, block_tokens=block))
    return out


def assign_tenants(reqs: list[BenchRequest], tenants: list[str], classes: list[str]) -> list[BenchRequest]:
    """Round-robin tenants; tenant i gets SLO class i mod len(classes) (deterministic, no RNG)."""
    if not tenants:
        return list(reqs)
    out = []
    for i, r in enumerate(reqs):
        t = i % len(tenants)
        out.append(replace(r, tenant=tenants[t], slo_class=classes[t % len(classes)] if classes else r.slo_class))
    return out
