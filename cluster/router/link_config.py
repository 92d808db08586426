"""The ingress link's settings (`LinkConfig`) and counters (`LinkStats`); see `cluster/router/link.py`."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LinkConfig:
    client_id: str = field(default_factory=lambda: f"ingress-{uuid.uuid4().hex[:8]}")
    admit_timeout_s: float = 2.0  # one placement decision, round trip included
    call_timeout_s: float = 10.0  # reports, rebuilds, recovery plans (off the hot path)
    report_interval_s: float = 0.1
    down_backoff_s: float = 1.0  # after a failed call, place locally this long before asking again
    ready_timeout_s: float = 5.0  # the first admit waits this long for the first report (heartbeats)
    block_size: int = 16  # the engines': prompts are hashed in blocks of this size
    max_pending_batches: int = 512  # unacknowledged event batches kept while the actor is away
    telemetry_interval_s: float = 0.5  # worker step times and prefix changes, relayed this often
    # With nothing in flight and nothing to tell, reports are heartbeats only, this often (at most a
    # quarter of the scheduler's `heartbeat_timeout_s`: workers silent that long are declared dead).
    idle_report_interval_s: float = 2.0
    # Telemetry on those heartbeats: nothing runs, so step times and prefix holdings barely move
    # (a store's evictions reach the scheduler up to this late; the first busy round relays it).
    idle_telemetry_interval_s: float = 30.0

    def __post_init__(self) -> None:
        if min(self.admit_timeout_s, self.call_timeout_s, self.report_interval_s, self.telemetry_interval_s,
               self.idle_report_interval_s, self.idle_telemetry_interval_s) <= 0:
            raise ValueError("timeouts and report and telemetry intervals must be positive")


@dataclass
class LinkStats:
    incarnation: str | None = None
    num_restarts_seen: int = 0
    num_admitted: int = 0
    num_refused: int = 0
    num_fallback: int = 0
    num_recover_calls: int = 0
    num_recover_fallback: int = 0
    num_reports: int = 0
    num_telemetry: int = 0  # worker telemetry windows relayed
    num_report_failures: int = 0
    num_rebuilds: int = 0
    num_rebuilt_requests: int = 0  # in-flight requests sent by the last rebuild
    num_dropped_batches: int = 0
    num_preempted: int = 0  # rows stopped on the scheduler's order
    num_not_preempted: int = 0  # rows the scheduler chose that could not stop (re-adopted)
    num_resumed: int = 0  # preempted requests placed again by the scheduler
