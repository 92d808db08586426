"""The dashboard's arithmetic: percentiles, rates over a sliding window, ratios of cumulative counters.

Mental model: every figure on the page is a pure function of (samples, now, window). Request
figures come from finished requests' timelines (latencies and the wall-clock instants they happened
at); cache figures come from cumulative counters that workers keep since they started, sampled each
time the page polls. Nothing here reads a clock or keeps global state, so tests feed hand-made
numbers and check exact answers.

Definitions (the ones `vllm bench serve` reports):
- percentile: linear interpolation between the closest ranks (numpy's default method);
- rate: events inside (now - span, now] divided by span, where span is the window, or the time
  since the source started if that is shorter (a server up for 5 s did not idle for 55 s);
- counter increase: `cur - prev`, except that a counter that went backwards was reset (its worker
  restarted), so the increase is `cur` (Prometheus' `increase()` rule).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (q in [0, 100]) by linear interpolation; None for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def window_span_s(now: float, window_s: float, since: float) -> float:
    """How many seconds a rate is averaged over: the window, cut short by the source's start."""
    return max(0.0, min(window_s, now - since))


def in_window(t: float, now: float, span_s: float) -> bool:
    return now - span_s < t <= now


def count_rate(times: Iterable[float], now: float, span_s: float) -> float:
    """Events per second inside (now - span_s, now]; 0 for an empty span."""
    if span_s <= 0.0:
        return 0.0
    return sum(1 for t in times if in_window(t, now, span_s)) / span_s


def counter_increase(prev: float | None, cur: float) -> float:
    """Increase of a cumulative counter between two readings. The first reading (`prev` None)
    counts whole: the counter started at zero when its worker did."""
    if prev is None or cur < prev:
        return cur
    return cur - prev


@dataclass(frozen=True)
class HitCount:
    """A cache's cumulative counters: `hits` out of `lookups` (tokens or blocks: the source says)."""

    hits: int
    lookups: int

    def __post_init__(self) -> None:
        assert 0 <= self.hits <= self.lookups, self


def hit_rate(count: HitCount) -> float | None:
    return count.hits / count.lookups if count.lookups else None


class CounterWindow:
    """Readings of one cumulative `HitCount`; `increase(now)` is what happened over the last window.

    A reading is kept until a newer one is at least a window old, so the window always has a
    baseline at or before its start. The first baseline is a zero reading at `origin` (when the
    dashboard started): what the counters held by then counts as having happened at that moment,
    and leaves the window `window_s` later like any other increase.
    """

    def __init__(self, window_s: float, origin: float) -> None:
        assert window_s > 0
        self.window_s = window_s
        self._readings: deque[tuple[float, HitCount]] = deque([(origin, HitCount(0, 0))])

    def add(self, t: float, count: HitCount) -> None:
        if self._readings and t < self._readings[-1][0]:
            raise ValueError(f"readings must come in time order ({t} after {self._readings[-1][0]})")
        self._readings.append((t, count))
        while len(self._readings) >= 2 and self._readings[1][0] <= t - self.window_s:
            self._readings.popleft()

    def increase(self, now: float) -> HitCount:
        """Hits and lookups summed over the readings since the window's baseline, resets included."""
        usable = [c for t, c in self._readings if t <= now]
        hits = lookups = 0.0
        for prev, cur in zip(usable, usable[1:]):  # the oldest reading is the baseline
            hits += counter_increase(prev.hits, cur.hits)
            lookups += counter_increase(prev.lookups, cur.lookups)
        return HitCount(int(hits), int(lookups))


def attainment(latencies: Iterable[tuple[float | None, float | None]], ttft_slo_ms: float,
               tpot_slo_ms: float) -> float | None:
    """Fraction of requests whose TTFT and TPOT both meet their targets; None for no requests.
    A request without a TPOT (one output token) meets the TPOT target; one without a TTFT (no
    token at all) meets neither."""
    met = total = 0
    for ttft_ms, tpot_ms in latencies:
        total += 1
        met += ttft_ms is not None and ttft_ms <= ttft_slo_ms and (tpot_ms is None or tpot_ms <= tpot_slo_ms)
    return met / total if total else None
