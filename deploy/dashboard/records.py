"""`RequestRecord`: one request's timeline in the single shape the dashboard and the metrics read.

Mental model: timelines come from several places with several shapes: the HTTP backends'
`TimelineRecorder` (milliseconds from arrival, plus a `prefill` section from the prefill worker
in disaggregated mode) and, later, the cluster scheduler's `RequestTimeline.breakdown()`
(absolute stamps on the scheduler's monotonic clock). Each shape gets one converter here; the
rest of deploy/ sees only records. Times inside a record are milliseconds from the request's
arrival; `arrival_unix_s` places it on the wall clock so windows over many requests line up.

Stages a source cannot tell apart are reported as one: the colocated engine cannot separate
queueing from prefill, so its first stage is `queue_prefill`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Drawing order on the page, and the names a source may use.
STAGES = ("queue", "prefix_lookup", "prefill_compute", "queue_prefill", "kv_transfer", "decode")


@dataclass(frozen=True)
class StageSpan:
    stage: str  # one of STAGES
    start_ms: float  # from arrival
    end_ms: float


@dataclass(frozen=True)
class PrefillReport:
    """What the prefill worker reported (disaggregated mode only)."""

    worker: str
    num_computed_tokens: int
    num_local_hit_blocks: int
    num_pool_hit_blocks: int
    kv_wire_bytes: int
    queued_ms: float
    lookup_ms: float
    compute_ms: float
    transfer_ms: float
    # The transfer's codec and why (forced, predicted, explore), its encode + send + decode time
    # predicted before and measured after (decode predicted); None from workers that predate it.
    kv_codec: str | None = None
    kv_codec_reason: str | None = None
    kv_codec_predicted_ms: float | None = None
    kv_codec_actual_ms: float | None = None
    kv_fidelity: str | None = None  # exact | lossy: the tenant's, which bounded the codecs allowed
    kv_raw_bytes: int | None = None  # the KV before its codec
    node: str | None = None  # the prefill worker's Ray node, and the decode worker's its KV went to
    kv_to_node: str | None = None


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    tenant: str
    arrival_unix_s: float
    finish_reason: str | None  # None while running; "abort" when the client left
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the engine found in its own prefix cache
    num_output_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None  # None unless it finished
    token_ms: tuple[float, ...]  # one per output token kept by the source
    stages: tuple[StageSpan, ...]
    prefill: PrefillReport | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def completed(self) -> bool:
        """Finished by the model (stop or length), not by a disconnect or a refusal."""
        return self.finish_reason not in (None, "abort", "refused")

    @property
    def itl_ms(self) -> tuple[float, ...]:
        return tuple(b - a for a, b in zip(self.token_ms, self.token_ms[1:]))

    @property
    def finish_unix_s(self) -> float | None:
        return None if self.e2e_ms is None else self.arrival_unix_s + self.e2e_ms / 1e3

    def token_unix_s(self) -> list[float]:
        return [self.arrival_unix_s + t / 1e3 for t in self.token_ms]


def _prefill(section: Mapping[str, Any] | None) -> PrefillReport | None:
    if not section:
        return None
    return PrefillReport(
        worker=str(section["worker"]), num_computed_tokens=int(section["computed_tokens"]),
        num_local_hit_blocks=int(section["local_hit_blocks"]), num_pool_hit_blocks=int(section["pool_hit_blocks"]),
        kv_wire_bytes=int(section["kv_wire_bytes"]), queued_ms=float(section["queued_s"]) * 1e3,
        lookup_ms=float(section["lookup_s"]) * 1e3, compute_ms=float(section["compute_s"]) * 1e3,
        transfer_ms=float(section["transfer_s"]) * 1e3, **_codec(section.get("kv_codec")),
        node=section.get("node"), kv_to_node=(section.get("kv_to") or {}).get("node"),
    )


def _codec(section: Mapping[str, Any] | None) -> dict[str, Any]:
    if not section:
        return {}
    return {"kv_codec": str(section["codec"]), "kv_codec_reason": str(section["reason"]),
            "kv_codec_predicted_ms": float(section["predicted_s"]) * 1e3,
            "kv_codec_actual_ms": float(section["actual_s"]) * 1e3,
            "kv_fidelity": None if section.get("fidelity") is None else str(section["fidelity"]),
            "kv_raw_bytes": None if section.get("kv_raw_bytes") is None else int(section["kv_raw_bytes"])}


def record_from_timeline(data: Mapping[str, Any]) -> RequestRecord:
    """From a backend's `timeline(request_id)` dict (deploy/openai/timeline.py, plus the `prefill`
    section ClusterBackend adds)."""
    token_ms = tuple(float(t) for t in data["token_times_ms"])
    ttft_ms = data.get("ttft_ms")
    prefill = _prefill(data.get("prefill"))
    stages: list[StageSpan] = []
    if ttft_ms is not None:
        if prefill is None:
            stages.append(StageSpan("queue_prefill", 0.0, ttft_ms))
        else:
            # The prefill worker's own stage times, laid end to end from arrival; what is left
            # until the first token is the decode worker admitting the request and stepping once.
            t = 0.0
            for stage, ms in (("queue", prefill.queued_ms), ("prefix_lookup", prefill.lookup_ms),
                              ("prefill_compute", prefill.compute_ms), ("kv_transfer", prefill.transfer_ms)):
                stages.append(StageSpan(stage, t, min(t + ms, ttft_ms)))
                t = min(t + ms, ttft_ms)
        stages.append(StageSpan("decode", stages[-1].end_ms, token_ms[-1] if token_ms else ttft_ms))
    return RequestRecord(
        request_id=str(data["request_id"]), tenant=str(data["tenant"]),
        arrival_unix_s=float(data["arrival_unix_s"]), finish_reason=data.get("finish_reason"),
        num_prompt_tokens=int(data.get("num_prompt_tokens", 0)),
        num_cached_tokens=int(data.get("num_cached_tokens", 0)),
        num_output_tokens=int(data.get("num_output_tokens", len(token_ms))), ttft_ms=ttft_ms,
        tpot_ms=data.get("tpot_ms"), e2e_ms=data.get("e2e_ms"), token_ms=token_ms, stages=tuple(stages),
        prefill=prefill,
    )


def record_from_breakdown(data: Mapping[str, Any], clock_to_unix_s: float) -> RequestRecord:
    """From the cluster scheduler's `RequestTimeline.breakdown()`. Its stamps are on the scheduler's
    monotonic clock; `clock_to_unix_s` is what to add to them to get wall-clock seconds
    (`time.time() - clock.now()`, read once in the scheduler's process)."""
    stamps = {str(k): float(v) for k, v in data["stamps"].items()}
    arrival = stamps["arrival"]

    def ms(t: float) -> float:
        return (t - arrival) * 1e3

    stages = []
    for stage, a, b in (("queue", "admitted", "prefill_start"),
                        ("prefix_lookup", "prefill_start", "prefix_lookup_done"),
                        ("prefill_compute", "prefix_lookup_done", "prefill_done"),
                        ("kv_transfer", "prefill_done", "kv_transfer_done"), ("decode", "first_token", "finished")):
        if a in stamps and b in stamps:
            stages.append(StageSpan(stage, ms(stamps[a]), ms(stamps[b])))
    finished = "finished" in stamps
    ttft_s, tpot_s, e2e_s = data.get("ttft_s"), data.get("tpot_s"), data.get("e2e_s")
    return RequestRecord(
        request_id=str(data["request_id"]), tenant=str(data["tenant"]), arrival_unix_s=arrival + clock_to_unix_s,
        finish_reason=("finished" if finished else ("refused" if "refused" in stamps else None)),
        num_prompt_tokens=0, num_cached_tokens=0, num_output_tokens=int(data["num_tokens"]),
        ttft_ms=None if ttft_s is None else ttft_s * 1e3, tpot_ms=None if tpot_s is None else tpot_s * 1e3,
        e2e_ms=None if e2e_s is None else e2e_s * 1e3, token_ms=tuple(ms(t) for t in data["token_times"]),
        stages=tuple(stages),
    )
