"""Trace loading and scaling for the simulator. The traces are read in place, never copied.

Mental model: a trace is a list of (arrival, prompt length, output length, prefix block ids).
Replaying it at rate R compresses or stretches the arrival times by one factor so the mean rate
over the window is R: burstiness and the length distributions keep their shape. Lengths are used
unscaled by default (the simulated GPU is an H200, not this machine); `length_scale` exists for
smaller simulated models. Mooncake's `hash_ids` (one per 512-token block, equal ids = equal
prefix) become chained 128-bit block hashes via `actors.engine.block_hash.hash_block_chain`, the
same function the engine and router use, so the scheduler sees the hashes it would see live.

Sources (see ../shared/traces/README.md): Azure LLM inference trace 2023, conversation
(CC-BY 4.0, Splitwise, ISCA 2024); Mooncake FAST'25 synthetic trace (Apache-2.0).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from actors.engine.block_hash import hash_block_chain

TRACE_DIR = Path(__file__).resolve().parents[3] / "shared" / "traces"
AZURE_CONV = "azure_llm_2023_conv.csv"
MOONCAKE = "mooncake_synthetic_trace.jsonl"
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    block_hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full blocks


def _trace_path(name: str, trace_dir: Path | None) -> Path:
    path = (trace_dir or TRACE_DIR) / name
    if not path.exists():
        raise FileNotFoundError(f"trace {path} not found; pass --trace-dir (the shared traces folder)")
    return path


def load_azure_conv(limit: int | None = None, trace_dir: Path | None = None) -> list[TraceRequest]:
    """Azure 2023 conversation trace: no prefix information (hash lists stay empty)."""
    out: list[TraceRequest] = []
    t0: datetime | None = None
    with _trace_path(AZURE_CONV, trace_dir).open() as f:
        for row in csv.DictReader(f):
            # Timestamps carry 7 fractional digits; datetime takes 6.
            t = datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f")
            t0 = t0 or t
            out.append(TraceRequest((t - t0).total_seconds(), max(1, int(row["ContextTokens"])),
                                    max(1, int(row["GeneratedTokens"]))))
            if limit is not None and len(out) >= limit:
                break
    return out


def load_mooncake(limit: int | None = None, trace_dir: Path | None = None) -> list[TraceRequest]:
    """Mooncake synthetic trace; hashes cover only the prompt's full 512-token blocks."""
    out: list[TraceRequest] = []
    with _trace_path(MOONCAKE, trace_dir).open() as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            n = int(d["input_length"])
            full = n // MOONCAKE_BLOCK_TOKENS
            hashes = tuple(hash_block_chain(d["hash_ids"][:full], 1)) if full else ()
            out.append(TraceRequest(d["timestamp"] / 1e3, max(1, n), max(1, int(d["output_length"])), hashes))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival_s)
    return out


def scale_to_rate(reqs: list[TraceRequest], rate: float, length_scale: float = 1.0) -> list[TraceRequest]:
    """Arrivals rescaled so the window's mean rate is `rate` req/s, starting at 0."""
    if len(reqs) < 2:
        return list(reqs)
    t0, span = reqs[0].arrival_s, reqs[-1].arrival_s - reqs[0].arrival_s
    factor = (len(reqs) - 1) / (span * rate) if span > 0 else 0.0
    out = []
    for r in reqs:
        scaled = replace(r, arrival_s=(r.arrival_s - t0) * factor)
        if length_scale != 1.0:
            scaled = replace(scaled, prompt_len=max(1, round(r.prompt_len * length_scale)),
                             output_len=max(1, round(r.output_len * length_scale)))
        out.append(scaled)
    return out


def native_rate(reqs: list[TraceRequest]) -> float:
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    return (len(reqs) - 1) / span if span > 0 else float("inf")
