"""The dashboard's arithmetic on hand-made numbers: every answer is exact."""

from __future__ import annotations

import pytest

from deploy.dashboard.window import (CounterWindow, HitCount, attainment, count_rate, counter_increase, hit_rate,
                                     percentile, window_span_s)


def test_percentile_interpolates_linearly_between_ranks() -> None:
    values = [40.0, 10.0, 30.0, 20.0]  # unsorted on purpose
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 40.0
    assert percentile(values, 50) == 25.0  # halfway between 20 and 30
    assert percentile(values, 99) == pytest.approx(39.7)  # 30 + 0.97 * 10
    assert percentile([7.5], 99) == 7.5
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="0, 100"):
        percentile(values, 101)


def test_percentile_matches_numpy_default() -> None:
    np = pytest.importorskip("numpy")
    values = [3.1, 9.4, 0.2, 5.5, 5.5, 12.0, 1.0]
    for q in (1, 25, 50, 90, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_rate_counts_events_inside_the_span_only() -> None:
    times = [100.0, 104.0, 105.0, 109.5, 110.0, 110.5]
    # (100, 110]: 104, 105, 109.5, 110 -> 4 events; 110.5 is in the future, 100.0 on the open edge.
    assert count_rate(times, now=110.0, span_s=10.0) == 0.4
    assert count_rate(times, now=110.0, span_s=0.0) == 0.0


def test_window_span_is_cut_short_by_the_start() -> None:
    assert window_span_s(now=1005.0, window_s=60.0, since=1000.0) == 5.0
    assert window_span_s(now=2000.0, window_s=60.0, since=1000.0) == 60.0
    assert window_span_s(now=999.0, window_s=60.0, since=1000.0) == 0.0


def test_counter_increase_treats_a_drop_as_a_restart() -> None:
    assert counter_increase(None, 7) == 7
    assert counter_increase(7, 12) == 5
    assert counter_increase(12, 3) == 3  # the worker restarted and counted 3 since


def test_counter_window_sums_increases_over_the_window_with_a_reset() -> None:
    w = CounterWindow(window_s=10.0, origin=0.0)
    w.add(1.0, HitCount(hits=4, lookups=10))  # held by the counters when the dashboard started
    assert w.increase(1.0) == HitCount(4, 10)
    w.add(5.0, HitCount(6, 20))
    assert w.increase(5.0) == HitCount(6, 20)
    w.add(12.0, HitCount(9, 30))
    # The zero reading at 0.0 is replaced as baseline by the one at 1.0 (a newer one, 5.0, is
    # not yet a window old): increases 1->5 and 5->12.
    assert w.increase(12.0) == HitCount(5, 20)
    w.add(16.0, HitCount(2, 4))  # reset: the worker restarted and has since seen 2 of 4
    # The window starts at 6.0; the newest reading at or before it (5.0) is the baseline.
    assert w.increase(16.0) == HitCount(3 + 2, 10 + 4)
    with pytest.raises(ValueError, match="time order"):
        w.add(15.0, HitCount(2, 4))


def test_hit_rate_and_attainment() -> None:
    assert hit_rate(HitCount(3, 12)) == 0.25
    assert hit_rate(HitCount(0, 0)) is None
    with pytest.raises(AssertionError):
        HitCount(5, 4)
    latencies = [(100.0, 20.0), (300.0, 20.0), (100.0, 60.0), (100.0, None), (None, None)]
    # met: #1 and #4 (no TPOT: one token); #2 misses TTFT, #3 TPOT, #5 never produced a token.
    assert attainment(latencies, ttft_slo_ms=200.0, tpot_slo_ms=50.0) == 0.4
    assert attainment([], 200.0, 50.0) is None
