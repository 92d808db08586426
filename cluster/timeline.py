"""Token-level latency breakdown of each request, kept for the most recent N requests.

Mental model: a request's life is a sequence of stamped stages

    arrival -> admitted -> prefill_start (queue ends) -> prefix_lookup_done -> prefill_done
      -> kv_transfer_done -> decode_admitted -> token, token, ... -> finished

plus one timestamp per streamed token. `RequestTimeline.breakdown()` turns the stamps into
durations (queue, prefix lookup, prefill compute, KV transfer, decode admission wait, TTFT, TPOT,
inter-token gaps) that the HTTP layer serves as JSON, with `decode_spec`: the draft tokens its
decode engines proposed and accepted (speculative decoding), reported with the request's end.
Stages a deployment does not report are simply absent. Memory is bounded twice: at most
`max_finished` finished timelines are kept (oldest dropped first), and at most `max_tokens_kept`
token stamps per request, as packed doubles (the count, the first and the last token are always
exact).
"""

from __future__ import annotations

import enum
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from cluster.descriptors import RequestId, TenantId


class Stage(str, enum.Enum):
    ARRIVAL = "arrival"
    ADMITTED = "admitted"
    PREFILL_START = "prefill_start"
    PREFIX_LOOKUP_DONE = "prefix_lookup_done"
    PREFILL_DONE = "prefill_done"
    KV_TRANSFER_DONE = "kv_transfer_done"
    DECODE_ADMITTED = "decode_admitted"
    FIRST_TOKEN = "first_token"
    FINISHED = "finished"
    REFUSED = "refused"
    PREEMPTED = "preempted"
    RECOVERED = "recovered"


def _gap(stamps: dict[Stage, float], a: Stage, b: Stage) -> float | None:
    if a in stamps and b in stamps:
        return stamps[b] - stamps[a]
    return None


@dataclass(slots=True)
class RequestTimeline:
    """Stamps of one request. The first stamp of a stage wins, except RECOVERED/PREEMPTED (last)."""

    request_id: RequestId
    tenant: TenantId
    max_tokens_kept: int
    stamps: dict[Stage, float] = field(default_factory=dict)
    token_times: array = field(default_factory=lambda: array("d"))  # 8 bytes a stamp
    num_tokens: int = 0
    last_token_time: float | None = None
    num_recoveries: int = 0
    spec: tuple[int, int] | None = None  # speculative decoding: draft tokens (proposed, accepted), every attempt

    def stamp(self, stage: Stage, t: float) -> None:
        if stage in (Stage.RECOVERED, Stage.PREEMPTED):
            self.stamps[stage] = t
            self.num_recoveries += stage is Stage.RECOVERED
        else:
            self.stamps.setdefault(stage, t)

    def token(self, t: float) -> None:
        if self.num_tokens == 0:
            self.stamp(Stage.FIRST_TOKEN, t)
        self.num_tokens += 1
        self.last_token_time = t
        if len(self.token_times) < self.max_tokens_kept:
            self.token_times.append(t)

    def breakdown(self) -> dict[str, Any]:
        s = self.stamps
        first = s.get(Stage.FIRST_TOKEN)
        tpot = None
        if first is not None and self.last_token_time is not None and self.num_tokens > 1:
            tpot = (self.last_token_time - first) / (self.num_tokens - 1)
        itl = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "stamps": {k.value: v for k, v in s.items()},
            "queue_s": _gap(s, Stage.ADMITTED, Stage.PREFILL_START),
            "prefix_lookup_s": _gap(s, Stage.PREFILL_START, Stage.PREFIX_LOOKUP_DONE),
            "prefill_compute_s": _gap(s, Stage.PREFIX_LOOKUP_DONE, Stage.PREFILL_DONE)
            if Stage.PREFIX_LOOKUP_DONE in s else _gap(s, Stage.PREFILL_START, Stage.PREFILL_DONE),
            "kv_transfer_s": _gap(s, Stage.PREFILL_DONE, Stage.KV_TRANSFER_DONE),
            "decode_admission_s": _gap(s, Stage.KV_TRANSFER_DONE, Stage.DECODE_ADMITTED),
            "ttft_s": _gap(s, Stage.ARRIVAL, Stage.FIRST_TOKEN),
            "tpot_s": tpot,
            "e2e_s": _gap(s, Stage.ARRIVAL, Stage.FINISHED),
            "num_tokens": self.num_tokens,
            "num_recoveries": self.num_recoveries,
            "max_itl_s": max(itl) if itl else None,
            "token_times": list(self.token_times),
            "decode_spec": None if self.spec is None else {
                "draft_tokens": self.spec[0], "accepted_tokens": self.spec[1],
                "acceptance_rate": self.spec[1] / self.spec[0] if self.spec[0] else None},
        }


class TimelineStore:
    """Live timelines by request id, plus a bounded, oldest-first-evicted set of finished ones."""

    def __init__(self, max_finished: int = 1000, max_tokens_kept: int = 512) -> None:
        if max_finished < 1 or max_tokens_kept < 1:
            raise ValueError("max_finished and max_tokens_kept must be >= 1")
        self.max_finished = max_finished
        self.max_tokens_kept = max_tokens_kept
        self._live: dict[RequestId, RequestTimeline] = {}
        self._finished: OrderedDict[RequestId, RequestTimeline] = OrderedDict()

    def start(self, rid: RequestId, tenant: TenantId, arrival_s: float) -> RequestTimeline:
        tl = RequestTimeline(rid, tenant, self.max_tokens_kept)
        tl.stamp(Stage.ARRIVAL, arrival_s)
        self._live[rid] = tl
        return tl

    def stamp(self, rid: RequestId, stage: Stage, t: float) -> None:
        tl = self._live.get(rid)
        if tl is not None:
            tl.stamp(stage, t)

    def token(self, rid: RequestId, t: float) -> None:
        tl = self._live.get(rid)
        if tl is not None:
            tl.token(t)

    def spec(self, rid: RequestId, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """What speculative decoding did for the request, as its decode worker reported at its end."""
        tl = self._live.get(rid)
        if tl is not None:
            tl.spec = (num_draft_tokens, num_accepted_tokens)

    def finish(self, rid: RequestId, t: float, stage: Stage = Stage.FINISHED) -> None:
        """Move a timeline to the finished set (stamping `stage`), evicting the oldest if full."""
        tl = self._live.pop(rid, None)
        if tl is None:
            return
        tl.stamp(stage, t)
        self._finished[rid] = tl
        while len(self._finished) > self.max_finished:
            self._finished.popitem(last=False)

    def get(self, rid: RequestId) -> dict[str, Any] | None:
        tl = self._live.get(rid) or self._finished.get(rid)
        return None if tl is None else tl.breakdown()

    def recent(self, limit: int = 100) -> list[dict[str, Any]]:
        """Breakdowns of the most recently finished requests, newest first."""
        out: list[dict[str, Any]] = []
        for tl in reversed(self._finished.values()):
            if len(out) >= limit:
                break
            out.append(tl.breakdown())
        return out

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_finished(self) -> int:
        return len(self._finished)
