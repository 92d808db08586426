"""A minimal discrete-event loop: a heap of (time, sequence, callback, args).

Mental model: simulated time jumps from one scheduled callback to the next; callbacks schedule
further callbacks. The sequence number breaks ties in scheduling order, so a run is a pure
function of its inputs (no wall clock, no randomness here).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    """`now` is the time of the callback being run."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.num_events = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._heap, (t if t > self.now else self.now, next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._heap, (self.now + dt, next(self._seq), fn, args))

    def run(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        """Run callbacks in time order up to `until` (simulated seconds), or until `stop()` holds
        (checked every 4096 events: it may be costly)."""
        heap = self._heap
        pop = heapq.heappop
        while heap and heap[0][0] <= until:
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            self.num_events += 1
            if stop is not None and self.num_events % 4096 == 0 and stop():
                return


class SimClock:
    """The scheduler's clock inside the simulator: the loop's simulated time."""

    def __init__(self, loop: EventLoop) -> None:
        self._loop = loop

    def now(self) -> float:
        return self._loop.now
