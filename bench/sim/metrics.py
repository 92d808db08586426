"""Per-run figures: SLO attainment, latency percentiles, prefix reuse and recovery after failures.

Mental model (as `vllm bench serve` defines them): TTFT = first token - arrival; TPOT = (last
token - first token) / (output tokens - 1); a request meets its SLO when it finished with both
within target. Refused, cancelled and unfinished requests count as misses, so shedding load can
only raise attainment by letting the *other* requests meet theirs. Percentiles are over finished
requests. Recovery: for every request that lost state to a failure (or was sent to a dead
instance before the death was noticed), the time from that moment to its next token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from bench.sim.request import SimRequest


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None when empty."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100.0 * len(s)) - 1))]


def meets(req: SimRequest, ttft_s: float, tpot_s: float) -> bool:
    if req.finish_t is None or req.first_token_t is None:
        return False
    return (req.first_token_t - req.arrival) <= ttft_s and (req.tpot or 0.0) <= tpot_s


def summarize(reqs: Sequence[SimRequest], ttft_s: float, tpot_s: float) -> dict[str, Any]:
    n = len(reqs)
    finished = [r for r in reqs if r.finish_t is not None]
    ttft = [r.ttft for r in finished if r.ttft is not None]
    tpot = [r.tpot for r in finished if r.tpot is not None and r.out_len > 1]
    met = sum(1 for r in reqs if meets(r, ttft_s, tpot_s))
    prompt_tokens = sum(r.prompt_len for r in reqs) or 1
    affected = [r for r in reqs if r.affected_at is not None]
    gaps = [r.resume_t - r.affected_at for r in affected if r.resume_t is not None and r.affected_at is not None]
    out: dict[str, Any] = {
        "num_requests": n,
        "attainment": met / n if n else 0.0,
        "num_met": met,
        "num_refused": sum(1 for r in reqs if r.refusal is not None),
        "num_unfinished": sum(1 for r in reqs if r.finish_t is None and r.refusal is None),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
        "prefix_cached_fraction": sum(r.num_cached_tokens for r in reqs) / prompt_tokens,
    }
    if affected:
        out["recovery"] = {
            "num_affected": len(affected),
            "num_recovered": len(gaps),
            "next_token_gap_p50_s": percentile(gaps, 50),
            "next_token_gap_max_s": max(gaps) if gaps else None,
            "affected_attainment": sum(1 for r in affected if meets(r, ttft_s, tpot_s)) / len(affected),
        }
    return out
