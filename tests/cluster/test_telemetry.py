"""TelemetryInbox: overlapping, repeated and restarted telemetry is applied exactly once."""

from __future__ import annotations

from cluster.descriptors import StepSample, WorkerKind, WorkerTelemetry
from tests.cluster.helpers import W, load, make


def _steps(*ids: int) -> tuple[StepSample, ...]:
    return tuple(StepSample(i, float(i), 0, 0, 0.01) for i in ids)


def test_windows_apply_once_and_gaps_wait_for_a_whole_set() -> None:
    sched, _ = make(prefill=1, decode=0)
    p0 = W("p0")
    model = sched.models.get(p0)
    sched.on_telemetry(WorkerTelemetry(p0, "a", 1, _steps(1, 2, 3), 1, cached_full=frozenset({1, 2})))
    # A second ingress relays an overlapping window: steps 2-3 and change 1 are known already.
    sched.on_telemetry(WorkerTelemetry(p0, "a", 2, _steps(2, 3, 4), 2, ((2, (3,), (1,)),)))
    assert model.num_samples == 4
    assert sched.telemetry.cursors() == {"p0": ("a", 4, 2)}
    assert sched.index.match((2, 3)) == {p0: 2} and sched.index.match((1,)) == {}
    # A change after a gap (change 3 never came) is not applied; the cursor stays, so the next
    # read brings the whole set.
    sched.on_telemetry(WorkerTelemetry(p0, "a", 5, (), 4, ((4, (9,), ()),)))
    assert sched.index.match((2, 3, 9)) == {p0: 2} and sched.telemetry.cursors()["p0"][2] == 2
    sched.on_telemetry(WorkerTelemetry(p0, "a", 5, (), 4, cached_full=frozenset({2, 3, 9})))
    assert sched.index.match((2, 3, 9)) == {p0: 3}
    # The worker restarted: its numbers start again and its cache is the new whole set.
    sched.on_telemetry(WorkerTelemetry(p0, "b", 1, _steps(7), 0, cached_full=frozenset()))
    assert model.num_samples == 5 and sched.index.match((2,)) == {}
    assert sched.telemetry.cursors() == {"p0": ("b", 1, 0)}
    sched.index.check_integrity()


def test_telemetry_of_unknown_or_dead_workers_is_dropped() -> None:
    sched, _ = make(prefill=1, decode=1)
    sched.on_telemetry(WorkerTelemetry(W("ghost"), "a", 1, _steps(1), 0, cached_full=frozenset({5})))
    assert sched.index.match((5,)) == {} and "ghost" not in sched.telemetry.cursors()
    sched.on_telemetry(WorkerTelemetry(W("d0"), "a", 1, _steps(1), 0, cached_full=frozenset({5})))
    sched.on_worker_dead(W("d0"))
    assert sched.index.match((5,)) == {} and sched.telemetry.cursors() == {}
    sched.on_report(load("d0", WorkerKind.DECODE))  # back (a restart): starts over from a whole set
    sched.on_telemetry(WorkerTelemetry(W("d0"), "a", 1, _steps(1), 0, ((1, (6,), ()),)))
    assert sched.index.match((6,)) == {}
