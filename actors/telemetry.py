"""Worker telemetry: what a worker's engine measured, numbered so any number of readers can follow it.

Mental model: the engine keeps its latest step records (`Engine.take_step_records`: prefill tokens,
attention pairs, decode rows, context, wall time) and its prefix cache (`Engine.cached_block_hashes`).
A worker's `TelemetryLog` moves the steps into a numbered ring and turns the cache into numbered
changes by diffing it with the last snapshot (`actors/holdings.py`), at most every `cache_interval_s` (the snapshot is
O(cached blocks), taken between steps). A reader passes the cursor of what it has applied (the
scheduler's own, relayed by an ingress from the last `ReportAck`) and gets what came after: the
steps after its step number, the cache changes after its change number, or, when the cursor is
missing, of another process, or older than the changes kept, the whole set of hashes. So readers
may overlap, repeat and restart, and each change is still applied exactly once (the reader keeps
only what its cursor has not covered: `cluster.telemetry.TelemetryInbox`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable

from actors.engine.async_engine import AsyncEngine
from actors.engine.output import StepRecord
from actors.holdings import HoldingsLog
from actors.messages import Telemetry, TelemetryCursor


class TelemetryLog:
    def __init__(self, name: str, async_engine: AsyncEngine, *, max_steps: int = 1024, max_changes: int = 64,
                 cache_interval_s: float = 0.2, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.engine = async_engine
        self.incarnation = uuid.uuid4().hex[:12]
        self.cache_interval_s = cache_interval_s
        self._clock = clock
        self._steps: deque[StepRecord] = deque(maxlen=max_steps)
        self._next_step_seq = 1
        self._cache = HoldingsLog(max_changes, self.incarnation)
        self._cache_at = float("-inf")
        self._lock = threading.Lock()  # reads come from several threads

    def read(self, cursor: TelemetryCursor | None = None) -> Telemetry:
        """Everything after `cursor` (blocking: call it off the event loop)."""
        with self._lock:
            self._collect()
            same = cursor is not None and cursor.incarnation == self.incarnation
            first_kept = self._next_step_seq - len(self._steps)
            first = max(first_kept, cursor.step_seq + 1) if same and cursor is not None else first_kept
            steps = tuple(itertools.islice(self._steps, max(0, first - first_kept), None))
            cache = self._cache.read(cursor.incarnation if cursor is not None else None,
                                     cursor.cache_seq if cursor is not None else 0)
            return Telemetry(self.name, self.incarnation, first, steps, cache.seq, cache.changes, cache.full)

    def _collect(self) -> None:
        for record in self.engine.engine.take_step_records():
            self._steps.append(record)
            self._next_step_seq += 1
        now = self._clock()
        if now - self._cache_at < self.cache_interval_s:
            return
        self._cache_at = now
        self._cache.update(frozenset(self.engine.locked(self.engine.engine.cached_block_hashes)))


class ReportsTelemetry:
    """A worker holding `engine` (an `AsyncEngine`) and `name` gets the `telemetry` method."""

    engine: AsyncEngine
    name: str
    _telemetry_log: TelemetryLog | None = None

    async def telemetry(self, cursor: TelemetryCursor | None = None) -> Telemetry:
        """This worker's engine steps and prefix-cache changes after `cursor`."""
        if self._telemetry_log is None:
            self._telemetry_log = TelemetryLog(self.name, self.engine)
        return await asyncio.to_thread(self._telemetry_log.read, cursor)
