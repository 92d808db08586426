"""Benchmark metrics exactly as `vllm bench serve` computes them, from per-request timelines.

Mental model: each request yields one `ClientRecord`: when it was sent, the arrival time of every
streamed chunk that carried text, and the output token count (from `usage` when the server sends
it, else the number of text chunks). Then, per successful request:
  TTFT = first text chunk - send;  E2E = last text chunk - send;
  ITL  = the gaps between consecutive text chunks;
  TPOT = (E2E - TTFT) / (output tokens - 1), only for outputs of more than one token
         (a 1-token output counts as TPOT 0 for goodput, and is left out of TPOT percentiles).
A failed request is one of: *refused* (429/503 whose OpenAI error body names a code, e.g.
`slo_unattainable`), *refused without a reason* (429/503 without one), *lost* (still unanswered
at the time bound: hung, as a client sees it), or another *error* (`failure_kind`).
A request is *good* when it succeeded and meets every SLO given (value <= SLO, in ms); goodput is
good requests / benchmark duration; attainment is good / all sent, per tenant. Percentiles are
numpy's linear interpolation, as vLLM's. Failed requests count in no latency, only against
attainment and goodput.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency promises in ms; None = not promised."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @staticmethod
    def parse(spec: str) -> "Slo":
        """`ttft:500,tpot:50[,e2el:MS]` (vLLM's --goodput keys)."""
        vals: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition(":")
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"bad SLO {part!r}: want ttft:MS, tpot:MS or e2el:MS")
            vals[f"{key}_ms"] = float(value)
        return Slo(**vals)


@dataclass(slots=True)
class ClientRecord:
    send_s: float  # monotonic clock
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    output_tokens: int | None = None  # usage.completion_tokens; None = count chunks
    prompt_tokens: int | None = None
    success: bool = False
    error: str = ""
    tenant: str = "default"
    slo_class: str = "default"
    request_id: str | None = None  # the server's x-request-id (ferry's timelines are keyed by it)
    status: int | None = None  # the HTTP status of the answer; None: no answer (transport error, cancelled)
    error_code: str | None = None  # an error answer's `error.code` (OpenAI error body), e.g. slo_unattainable
    cancelled: bool = False  # still unanswered when the time bound ran out: lost or hung, as a client sees it

    @property
    def num_output(self) -> int:
        return self.output_tokens if self.output_tokens is not None else len(self.chunk_s)

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.send_s

    @property
    def e2el_s(self) -> float:
        return self.chunk_s[-1] - self.send_s

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def tpot_s(self) -> float:
        """0 for 1-token outputs (vLLM's convention for the goodput check)."""
        n = self.num_output
        return (self.e2el_s - self.ttft_s) / (n - 1) if n > 1 else 0.0


FAILURE_KINDS = ("refused", "refused_no_reason", "lost", "error")


def failure_kind(r: ClientRecord) -> str | None:
    """None for a success, else one of `FAILURE_KINDS`."""
    if r.success and r.chunk_s:
        return None
    if r.cancelled:
        return "lost"
    if r.status in (429, 503):
        return "refused" if r.error_code else "refused_no_reason"
    return "error"


def is_good(r: ClientRecord, slo: Slo) -> bool:
    if not r.success or not r.chunk_s:
        return False
    checks = ((slo.ttft_ms, r.ttft_s), (slo.tpot_ms, r.tpot_s), (slo.e2el_ms, r.e2el_s))
    return all(limit is None or value * 1000.0 <= limit for limit, value in checks)


def _stats_ms(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    arr = np.asarray(values_s) * 1000.0
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


@dataclass(frozen=True, slots=True)
class Summary:
    num_sent: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed / s
    output_throughput: float  # output tokens / s
    goodput: float  # good requests / s
    attainment: float  # good / sent
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    tenants: dict[str, dict[str, float]]  # tenant -> {sent, ok, good, attainment, ttft_p99_ms, tpot_p99_ms}
    # completed requests over each promise (one request may miss both): which SLO the misses come from
    missed: dict[str, int] = field(default_factory=dict)
    # failed requests by `failure_kind`, and refusals by their error code
    failures: dict[str, int] = field(default_factory=dict)
    refusal_codes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def failures_text(self) -> str:
        """e.g. `12 failed: 12 refused with a reason (slo_unattainable 12), 0 refused without one,
        0 lost (unanswered at the time bound), 0 other errors`."""
        f = self.failures
        codes = ", ".join(f"{c} {n}" for c, n in sorted(self.refusal_codes.items()))
        return (f"{self.failed} failed: {f.get('refused', 0)} refused with a reason" + (f" ({codes})" if codes else "")
                + f", {f.get('refused_no_reason', 0)} refused without one, {f.get('lost', 0)} lost (unanswered at"
                f" the time bound), {f.get('error', 0)} other errors")


def summarize(records: list[ClientRecord], duration_s: float, slos: dict[str, Slo]) -> Summary:
    """`slos` maps SLO class -> promises; a class not in it has none (every success is good)."""
    ok = [r for r in records if r.success and r.chunk_s]
    good = [is_good(r, slos.get(r.slo_class, Slo())) for r in records]
    tenants: dict[str, dict[str, float]] = {}
    for r, g in zip(records, good):
        t = tenants.setdefault(r.tenant, {"sent": 0, "good": 0, "attainment": 0.0})
        t["sent"] += 1
        t["good"] += int(g)
    for name, t in tenants.items():
        t["attainment"] = t["good"] / t["sent"]
        mine = [r for r in ok if r.tenant == name]
        t["ok"] = len(mine)
        t["ttft_p99_ms"] = _stats_ms([r.ttft_s for r in mine])["p99"]
        t["tpot_p99_ms"] = _stats_ms([r.tpot_s for r in mine if r.num_output > 1])["p99"]
    dur = max(duration_s, 1e-9)
    missed = {"ttft": 0, "tpot": 0, "e2el": 0}
    for r in ok:
        slo = slos.get(r.slo_class, Slo())
        for name, limit, value in (("ttft", slo.ttft_ms, r.ttft_s), ("tpot", slo.tpot_ms, r.tpot_s),
                                   ("e2el", slo.e2el_ms, r.e2el_s)):
            if limit is not None and value * 1000.0 > limit:
                missed[name] += 1
    failures = dict.fromkeys(FAILURE_KINDS, 0)
    codes: dict[str, int] = {}
    for r in records:
        if (kind := failure_kind(r)) is not None:
            failures[kind] += 1
            if kind == "refused":
                codes[r.error_code] = codes.get(r.error_code, 0) + 1
    return Summary(
        num_sent=len(records), completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        request_throughput=len(ok) / dur, output_throughput=sum(r.num_output for r in ok) / dur,
        goodput=sum(good) / dur, attainment=sum(good) / max(len(records), 1),
        ttft_ms=_stats_ms([r.ttft_s for r in ok]),
        tpot_ms=_stats_ms([r.tpot_s for r in ok if r.num_output > 1]),
        itl_ms=_stats_ms([g for r in ok for g in r.itl_s]),
        e2el_ms=_stats_ms([r.e2el_s for r in ok]), tenants=tenants, missed=missed,
        failures=failures, refusal_codes=codes,
    )
