"""Clocks: every policy class reads time through one of these, never from `time` directly.

Mental model: the scheduler is a pure function of (events, clock readings). Tests and the simulator
inject a `FakeClock` they advance by hand, so a decision made at "t = 3.0 s" is exactly
reproducible; production passes `WallClock` (service.py).
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds on one timeline; only differences are meaningful."""

    def now(self) -> float: ...


class WallClock:
    """Seconds since the epoch: the one timeline processes on different machines share (what the
    scheduler actor uses: arrival and token times come from other processes)."""

    def now(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to; never backwards."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance(self, dt_s: float) -> float:
        if dt_s < 0:
            raise ValueError(f"a clock cannot go backwards (dt={dt_s})")
        self._t += dt_s
        return self._t

    def set(self, t: float) -> float:
        if t < self._t:
            raise ValueError(f"a clock cannot go backwards ({t} < {self._t})")
        self._t = float(t)
        return self._t
