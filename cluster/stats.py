"""Scheduler statistics: plain dataclasses that deploy/ maps to Prometheus, bench/ to tables.

Mental model: counters are cumulative since start; decision latency is kept as a ring buffer of
the most recent decisions (wall-clock microseconds, measured with `perf_counter` whatever clock
the policy runs on) and summarised on demand, so recording costs O(1) per decision.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field


class LatencyWindow:
    """The last `capacity` samples (seconds); percentiles computed on demand."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._buf = array("d")
        self._next = 0
        self.count = 0

    def add(self, seconds: float) -> None:
        if len(self._buf) < self.capacity:
            self._buf.append(seconds)
        else:
            self._buf[self._next] = seconds
            self._next = (self._next + 1) % self.capacity
        self.count += 1

    def percentile(self, q: float) -> float | None:
        """Nearest-rank percentile, q in [0, 100]; None before any sample."""
        if not self._buf:
            return None
        ordered = sorted(self._buf)
        rank = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
        return ordered[rank]

    def clear(self) -> None:
        self._buf = array("d")
        self._next = 0
        self.count = 0


@dataclass(slots=True)
class WorkerStats:
    name: str
    kind: str
    healthy: bool
    prefill_backlog_s: float
    num_prefill_queued: int
    num_decode_committed: int
    num_decode_active: int
    free_blocks: int
    decode_batch_cap: int
    step_model_coefficients: tuple[float, ...]
    step_model_samples: int = 0  # the worker's own measured steps; 0: it borrows the fleet's fit


@dataclass(slots=True)
class SchedulerStats:
    num_submitted: int = 0
    num_placed: int = 0
    num_finished: int = 0
    num_in_flight: int = 0
    num_refused: dict[str, int] = field(default_factory=dict)
    num_recovered: int = 0
    num_preempted: int = 0
    num_resumed: int = 0
    num_expired: int = 0
    num_workers_lost: int = 0
    decision_p50_us: float | None = None
    decision_p99_us: float | None = None
    decision_max_us: float | None = None
    served_tokens_by_tenant: dict[str, float] = field(default_factory=dict)
    workers: list[WorkerStats] = field(default_factory=list)
