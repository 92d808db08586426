"""Per-request token timelines kept by a backend: when each output token reached the front.

Mental model: a trace is opened when a request is handed to the engine and fed every output delta
(each carries the monotonic time the engine produced it); finished traces stay in a bounded LRU so
`GET /v1/requests/{id}/timeline` can show recent requests. In the colocated engine queueing and
prefill cannot be told apart from outside, so the first stage ("prefill", queueing included) ends
at the first token and "decode" runs from there to the last token. All times in the answer are
milliseconds from arrival. `decode.spec` is what speculative decoding did for the request: draft
tokens its decode engine proposed and accepted (the outputs' running totals, over every attempt);
`decode.workers` the workers that streamed its tokens, in order (one more for each resume elsewhere).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from actors.engine.output import RequestOutput


@dataclass
class Trace:
    request_id: str
    tenant: str
    arrival_unix_s: float = field(default_factory=time.time)
    arrival: float = field(default_factory=time.monotonic)
    token_times: list[float] = field(default_factory=list)  # monotonic, one per output token
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    # Speculative decoding's running totals for the request (every output carries them; a
    # resumed request's count from its first attempt): draft tokens proposed, and accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    workers: list[str] = field(default_factory=list)  # that streamed its tokens, in order (a resume adds one)

    def on_worker(self, worker: str) -> None:
        if worker and (not self.workers or self.workers[-1] != worker):
            self.workers.append(worker)

    def on_output(self, out: RequestOutput) -> None:
        self.token_times.extend([out.time] * len(out.new_token_ids))
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.num_draft_tokens, self.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
        if out.finished:
            self.finish_reason = out.finish_reason

    def to_dict(self) -> dict[str, Any]:
        times_ms = [round((t - self.arrival) * 1e3, 3) for t in self.token_times]
        itl_ms = [round(b - a, 3) for a, b in zip(times_ms, times_ms[1:])]
        ttft_ms = times_ms[0] if times_ms else None
        e2e_ms = times_ms[-1] if self.finish_reason is not None and times_ms else None
        # TPOT as vLLM defines it: decode time over the tokens after the first.
        tpot_ms = round((times_ms[-1] - times_ms[0]) / (len(times_ms) - 1), 3) if len(times_ms) > 1 else None
        stages: list[dict[str, Any]] = []
        if ttft_ms is not None:
            stages.append({"stage": "prefill", "start_ms": 0.0, "end_ms": ttft_ms})
            stages.append({"stage": "decode", "start_ms": ttft_ms, "end_ms": times_ms[-1]})
        return {
            "request_id": self.request_id,
            "tenant": self.tenant,
            "status": "running" if self.finish_reason is None else "finished",
            "arrival_unix_s": self.arrival_unix_s,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_output_tokens": len(times_ms),
            "finish_reason": self.finish_reason,
            "ttft_ms": ttft_ms,
            "tpot_ms": tpot_ms,
            "e2e_ms": e2e_ms,
            "stages": stages,
            "token_times_ms": times_ms,
            "itl_ms": itl_ms,
            "decode": {"spec": self.spec(), "workers": list(self.workers)},
        }

    def spec(self) -> dict[str, Any]:
        """`decode.spec`: the request's draft tokens, accepted ones, and their ratio (None: no drafts)."""
        n, accepted = self.num_draft_tokens, self.num_accepted_tokens
        rate = round(accepted / n, 4) if n else None
        return {"draft_tokens": n, "accepted_tokens": accepted, "acceptance_rate": rate}


class TimelineRecorder:
    """The last `capacity` requests' traces, oldest dropped first. Used from one event loop only."""

    def __init__(self, capacity: int = 1024) -> None:
        assert capacity > 0
        self.capacity = capacity
        self._traces: OrderedDict[str, Trace] = OrderedDict()

    def open(self, request_id: str, tenant: str) -> Trace:
        trace = Trace(request_id, tenant)
        self._traces[request_id] = trace
        self._traces.move_to_end(request_id)
        while len(self._traces) > self.capacity:
            self._traces.popitem(last=False)
        return trace

    def request_ids(self) -> list[str]:
        """The recent requests held, oldest first."""
        return list(self._traces)

    def discard(self, request_id: str) -> None:
        self._traces.pop(request_id, None)

    def get(self, request_id: str) -> dict[str, Any] | None:
        trace = self._traces.get(request_id)
        return None if trace is None else trace.to_dict()
