"""Token-level latency breakdown and its bounded store."""

from __future__ import annotations

import time

import pytest

from actors.engine.output import RequestOutput
from actors.engine.sampling import SamplingParams
from actors.messages import GenerationRequest, TokenEvent
from cluster.config import SchedulerConfig
from cluster.descriptors import RequestId, TenantId, WorkerKind, WorkerName, WorkerReport
from cluster.flights import EventKind, FlightEvent
from cluster.placement import Placement
from cluster.router.adapters import request_desc
from cluster.router.flight import InFlight
from cluster.service import SchedulerService
from cluster.timeline import Stage, TimelineStore


def test_breakdown_durations_are_exact() -> None:
    store = TimelineStore(max_finished=2, max_tokens_kept=3)
    rid = RequestId("a")
    store.start(rid, TenantId("t"), 10.0)
    for stage, t in ((Stage.ADMITTED, 10.001), (Stage.PREFILL_START, 10.1), (Stage.PREFIX_LOOKUP_DONE, 10.102),
                     (Stage.PREFILL_DONE, 10.3), (Stage.KV_TRANSFER_DONE, 10.32), (Stage.DECODE_ADMITTED, 10.33)):
        store.stamp(rid, stage, t)
    for t in (10.3, 10.35, 10.40, 10.47, 10.50):
        store.token(rid, t)
    store.finish(rid, 10.5)
    b = store.get(rid)
    assert b is not None
    assert b["queue_s"] == pytest.approx(0.099)
    assert b["prefix_lookup_s"] == pytest.approx(0.002)
    assert b["prefill_compute_s"] == pytest.approx(0.198)
    assert b["kv_transfer_s"] == pytest.approx(0.02)
    assert b["decode_admission_s"] == pytest.approx(0.01)
    assert b["ttft_s"] == pytest.approx(0.3)
    assert b["tpot_s"] == pytest.approx(0.05)
    assert b["e2e_s"] == pytest.approx(0.5)
    assert b["num_tokens"] == 5 and b["token_times"] == [10.3, 10.35, 10.40]  # capped at 3 stamps
    assert b["max_itl_s"] == pytest.approx(0.05)


def test_store_keeps_only_the_most_recent_finished() -> None:
    store = TimelineStore(max_finished=2)
    for i in range(4):
        rid = RequestId(f"r{i}")
        store.start(rid, TenantId("t"), float(i))
        store.finish(rid, i + 0.5)
    assert [b["request_id"] for b in store.recent()] == ["r3", "r2"]
    assert store.get(RequestId("r0")) is None and store.num_finished == 2


def test_a_finished_request_carries_what_speculative_decoding_did() -> None:
    """The ingress reports a request's draft tokens with its end (`FlightEvent.spec`, over every
    attempt); its timeline shows them as `decode_spec`. A cancelled request has none."""
    svc = SchedulerService(SchedulerConfig(heartbeat_timeout_s=60.0))
    svc.rebuild("ing", [], [WorkerReport(WorkerName(n), kind, 0, 0, 1000, 1000) for n, kind in (
        ("p0", WorkerKind.PREFILL), ("d0", WorkerKind.DECODE))])
    for rid in ("done", "gone"):
        req = GenerationRequest(rid, tuple(range(4, 40)), SamplingParams(max_tokens=8))
        assert isinstance(svc.submit(request_desc(req), req.seed), Placement)
    flight = InFlight(GenerationRequest("done", (4, 5), SamplingParams(max_tokens=8)))
    flight.on_event(TokenEvent(RequestOutput("done", (9,), "a", "a", (9,), num_draft_tokens=6, num_accepted_tokens=4),
                               0.0, "d0"))
    flight.next_attempt()  # resumed elsewhere: that engine counts from 0
    flight.on_event(TokenEvent(RequestOutput("done", (7,), "b", "b", (7,), num_draft_tokens=3, num_accepted_tokens=1),
                               0.0, "d1"))
    assert flight.spec_totals == (9, 5)
    t = time.time()
    svc.report("ing", [(1, [FlightEvent(EventKind.FINISH, RequestId("done"), t, num_output_tokens=8,
                                        spec=flight.spec_totals),
                            FlightEvent(EventKind.CANCEL, RequestId("gone"), t)])])
    done, gone = svc.timeline("done"), svc.timeline("gone")
    assert done is not None and gone is not None
    assert done["decode_spec"] == {"draft_tokens": 9, "accepted_tokens": 5, "acceptance_rate": pytest.approx(5 / 9)}
    assert gone["decode_spec"] is None
    store = TimelineStore()
    store.start(RequestId("z"), TenantId("t"), 0.0)
    store.spec(RequestId("z"), 0, 0)
    store.spec(RequestId("unknown"), 1, 1)  # not live: ignored
    assert store.get(RequestId("z"))["decode_spec"] == {  # type: ignore[index]
        "draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None}
