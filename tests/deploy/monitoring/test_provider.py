"""Timelines -> records -> dashboard figures, on hand-made timelines and a fake clock."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from actors.engine.output import RequestOutput
from actors.messages import WorkerLoad
from cluster.tenants import BatchSlo, InteractiveSlo
from deploy.dashboard.model import SloTargets
from deploy.dashboard.provider import (BackendTimelines, DashboardSources, StaticSlos, TimelineDashboard,
                                       timeline_tiers, tokens_in_window)
from deploy.dashboard.records import RequestRecord, StageSpan, record_from_breakdown, record_from_timeline
from deploy.dashboard.window import HitCount
from deploy.openai.timeline import TimelineRecorder


def timeline(rid: str, tenant: str, arrival: float, tokens_ms: list[float], finish: str | None, *,
             prompt: int = 10, cached: int = 0, prefill: dict[str, Any] | None = None) -> dict[str, Any]:
    """The dict shape of deploy/openai/timeline.py's `Trace.to_dict()`."""
    data: dict[str, Any] = {
        "request_id": rid, "tenant": tenant, "status": "running" if finish is None else "finished",
        "arrival_unix_s": arrival, "num_prompt_tokens": prompt, "num_cached_tokens": cached,
        "num_output_tokens": len(tokens_ms), "finish_reason": finish,
        "ttft_ms": tokens_ms[0] if tokens_ms else None,
        "tpot_ms": (tokens_ms[-1] - tokens_ms[0]) / (len(tokens_ms) - 1) if len(tokens_ms) > 1 else None,
        "e2e_ms": tokens_ms[-1] if finish is not None and tokens_ms else None,
        "stages": [], "token_times_ms": tokens_ms, "itl_ms": [],
    }
    if prefill is not None:
        data["prefill"] = prefill
    return data


PREFILL = {"worker": "p0", "computed_tokens": 16, "local_hit_blocks": 1, "pool_hit_blocks": 2,
           "kv_wire_bytes": 4096, "queued_s": 0.002, "lookup_s": 0.003, "compute_s": 0.010, "transfer_s": 0.005}

TIMELINES = [  # newest first, as a source hands them out
    timeline("r6", "acme", 1004.0, [20.0], "abort"),
    timeline("r4", "acme", 1003.0, [40.0], None),
    timeline("r3", "batchco", 1002.0, [30.0], "stop"),
    timeline("r2", "acme", 1001.0, [150.0, 170.0], "length", prompt=20),
    timeline("r1", "acme", 1000.0, [50.0, 60.0, 70.0], "stop", prompt=32, cached=16),
    timeline("r0", "acme", 900.0, [50.0], "stop"),  # finished before the window
]


class Timelines:
    def __init__(self, dicts: list[dict[str, Any]]) -> None:
        self.records = [record_from_timeline(d) for d in dicts]

    def recent_records(self, limit: int) -> list[RequestRecord]:
        return self.records[:limit]


class Loads:
    async def loads(self) -> Mapping[str, WorkerLoad]:
        return {"d0": WorkerLoad("d0", "decode", 3, 1, 2, 40, 100, 0.012, True, 700 << 20),
                "p0": WorkerLoad("p0", "prefill", 1, 4, 0, 90, 100, 0.050, False)}


class Refusals:
    def refusals(self) -> Mapping[str, int]:
        return {"tenant_over_budget": 2}


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_record_of_a_colocated_request() -> None:
    r = record_from_timeline(TIMELINES[4])
    assert (r.ttft_ms, r.tpot_ms, r.e2e_ms, r.itl_ms) == (50.0, 10.0, 70.0, (10.0, 10.0))
    assert r.stages == (StageSpan("queue_prefill", 0.0, 50.0), StageSpan("decode", 50.0, 70.0))
    assert r.completed and r.finish_unix_s == 1000.07
    assert not record_from_timeline(TIMELINES[0]).completed  # abort
    assert not record_from_timeline(TIMELINES[1]).finished


def test_record_of_a_disaggregated_request_lays_prefill_stages_end_to_end() -> None:
    r = record_from_timeline(timeline("x", "acme", 0.0, [25.0, 30.0], "stop", prompt=64, prefill=PREFILL))
    assert r.stages == (StageSpan("queue", 0.0, 2.0), StageSpan("prefix_lookup", 2.0, 5.0),
                        StageSpan("prefill_compute", 5.0, 15.0), StageSpan("kv_transfer", 15.0, 20.0),
                        StageSpan("decode", 20.0, 30.0))
    assert r.prefill is not None and r.prefill.kv_wire_bytes == 4096
    # Reused 64 - 16 = 48 prompt tokens: 1 of 3 blocks from the engine, 2 from the pool.
    assert timeline_tiers([r]) == {"hbm": HitCount(16, 64), "pool": HitCount(32, 64)}


def test_record_of_a_scheduler_breakdown() -> None:
    stamps = {"arrival": 10.0, "admitted": 10.001, "prefill_start": 10.004, "prefix_lookup_done": 10.005,
              "prefill_done": 10.020, "kv_transfer_done": 10.024, "first_token": 10.030, "finished": 10.050}
    r = record_from_breakdown({"request_id": "q", "tenant": "acme", "stamps": stamps, "ttft_s": 0.030,
                               "tpot_s": 0.010, "e2e_s": 0.050, "num_tokens": 3,
                               "token_times": [10.030, 10.040, 10.050]}, clock_to_unix_s=1000.0)
    assert r.arrival_unix_s == 1010.0 and r.num_output_tokens == 3 and r.completed
    assert [s.stage for s in r.stages] == ["queue", "prefix_lookup", "prefill_compute", "kv_transfer", "decode"]
    assert r.stages[0].start_ms == pytest.approx(1.0) and r.stages[-1].end_ms == pytest.approx(50.0)
    assert r.token_ms == pytest.approx((30.0, 40.0, 50.0))


def test_dashboard_figures_over_the_window() -> None:
    clock = Clock(940.0)
    slos = StaticSlos({"acme": {"ttft_ms": 120, "tpot_ms": 15}, "batchco": BatchSlo(deadline_s=3600),
                       "idle": InteractiveSlo(ttft_ms=500.0, tpot_ms=40.0)})
    assert slos.slo("idle") == SloTargets(500.0, 40.0) and slos.slo("nobody") is None
    provider = TimelineDashboard(DashboardSources(Timelines(TIMELINES), Loads(), slos=slos, refusals=Refusals()),
                                 window_s=60.0, num_recent=3, clock=clock)
    clock.t = 1010.0
    data = asyncio.run(provider.dashboard_data())
    tenants = {t.tenant: t for t in data.tenants}
    assert list(tenants) == ["acme", "batchco", "idle"]
    acme = tenants["acme"]
    # Completed in the window: r1 (ttft 50, tpot 10) and r2 (ttft 150, tpot 20).
    assert (acme.num_completed, acme.num_running, acme.num_output_tokens) == (2, 1, 5)
    assert (acme.ttft_p50_ms, acme.ttft_p99_ms) == (100.0, pytest.approx(149.0))
    assert (acme.tpot_p50_ms, acme.tpot_p99_ms) == (15.0, pytest.approx(19.9))
    assert acme.slo == SloTargets(120.0, 15.0) and acme.slo_attainment == 0.5  # r2 misses both
    batch = tenants["batchco"]
    assert (batch.ttft_p50_ms, batch.tpot_p50_ms, batch.slo, batch.slo_attainment) == (30.0, None, None, None)
    idle = tenants["idle"]
    assert (idle.num_completed, idle.ttft_p99_ms, idle.slo_attainment) == (0, None, None)
    tp = data.throughput
    # Span 60 s (up 70 s); 3 completed; tokens of r1 (3), r2 (2), r3, r4, r6 (1 each) in (950, 1010].
    assert (tp.span_s, tp.num_completed, tp.num_output_tokens) == (60.0, 3, 8)
    assert (tp.requests_per_s, tp.output_tokens_per_s) == (0.05, 8 / 60)
    assert [(w.name, w.kv_blocks_used, w.healthy) for w in data.workers] == [("d0", 60, True), ("p0", 10, False)]
    assert data.workers[0].last_step_ms == 12.0
    assert (data.workers[0].rss_mib, data.workers[1].rss_mib) == (700, None)
    assert [(t.tier, t.hits, t.lookups, t.hit_rate) for t in data.tiers] == [("hbm", 16, 62, 16 / 62)]
    assert data.refusals == {"tenant_over_budget": 2}
    assert [b.request_id for b in data.recent] == ["r6", "r4", "r3"]
    assert data.recent[1].status == "running" and data.notes == []


def test_slo_report_holds_each_tenants_attainment_and_the_default_contract() -> None:
    clock = Clock(940.0)
    # acme listed; everyone else (batchco here) under the default contract, as the scheduler does.
    slos = StaticSlos({"acme": InteractiveSlo(ttft_ms=120.0, tpot_ms=15.0)}, InteractiveSlo(ttft_ms=40.0, tpot_ms=5.0))
    assert slos.slo("anyone") == SloTargets(40.0, 5.0) and list(slos.known_tenants()) == ["acme"]
    assert StaticSlos({}, BatchSlo(deadline_s=60)).slo("anyone") is None
    provider = TimelineDashboard(DashboardSources(Timelines(TIMELINES), Loads(), slos=slos), clock=clock)
    clock.t = 1010.0
    report = provider.slo_report()
    assert report == {"window_s": 60.0, "tenants": {
        "acme": {"ttft_slo_ms": 120.0, "tpot_slo_ms": 15.0, "completed": 2, "running": 1, "attainment": 0.5,
                 "ttft_p99_ms": pytest.approx(149.0), "tpot_p99_ms": pytest.approx(19.9)},
        "batchco": {"ttft_slo_ms": 40.0, "tpot_slo_ms": 5.0, "completed": 1, "running": 0, "attainment": 1.0,
                    "ttft_p99_ms": 30.0, "tpot_p99_ms": None},  # r3: TTFT 30 ms, one token
    }}
    clock.t = 1100.0  # everything has left the window
    assert provider.slo_report()["tenants"]["acme"] == {
        "ttft_slo_ms": 120.0, "tpot_slo_ms": 15.0, "completed": 0, "running": 1, "attainment": None,
        "ttft_p99_ms": None, "tpot_p99_ms": None}


def test_a_failing_source_becomes_a_note_and_counters_beat_the_estimate() -> None:
    class Broken:
        async def loads(self) -> Mapping[str, WorkerLoad]:
            raise RuntimeError("boom")

    class Counters:
        def __init__(self) -> None:
            self.counts = {"hbm": HitCount(30, 100), "dram": HitCount(2, 8)}

        async def prefix_counts(self) -> Mapping[str, HitCount]:
            return self.counts

    clock, counters = Clock(1000.0), Counters()
    provider = TimelineDashboard(DashboardSources(Timelines(TIMELINES), Broken(), counters), clock=clock)
    clock.t = 1001.0
    data = asyncio.run(provider.dashboard_data())
    assert data.workers == [] and data.notes == ["worker loads unavailable: RuntimeError: boom"]
    assert [(t.tier, t.unit, t.hits, t.lookups) for t in data.tiers] == [("dram", "blocks", 2, 8),
                                                                          ("hbm", "tokens", 30, 100)]
    counters.counts = {"hbm": HitCount(40, 150), "dram": HitCount(2, 8)}
    clock.t = 1002.0
    data = asyncio.run(provider.dashboard_data())
    assert {t.tier: (t.hits, t.lookups) for t in data.tiers} == {"dram": (2, 8), "hbm": (40, 150)}
    clock.t = 1063.0  # the readings at 1001 and 1002 leave the window; nothing happened since
    data = asyncio.run(provider.dashboard_data())
    assert {t.tier: (t.hits, t.lookups, t.hit_rate) for t in data.tiers} == {"dram": (0, 0, None),
                                                                              "hbm": (0, 0, None)}


def test_backend_timelines_lists_a_recorder_newest_first() -> None:
    recorder = TimelineRecorder(capacity=3)

    class Backend:
        timelines = recorder

        def timeline(self, rid: str) -> dict[str, Any] | None:
            return recorder.get(rid)

    for i in range(4):  # the oldest falls out of the recorder
        trace = recorder.open(f"r{i}", "acme")
        trace.on_output(RequestOutput(f"r{i}", (7,), "x", "x", (7,), finished=True, finish_reason="stop",
                                      num_prompt_tokens=5, time=trace.arrival + 0.010))
    records = BackendTimelines(Backend()).recent_records(limit=2)
    assert [r.request_id for r in records] == ["r3", "r2"]
    assert records[0].ttft_ms == 10.0 and records[0].completed


def test_tokens_in_window_counts_a_request_straddling_the_edge() -> None:
    r = record_from_timeline(timeline("r", "acme", 100.0, [500.0, 1500.0, 2500.0, 3500.0], "stop"))
    # Tokens at 100.5, 101.5, 102.5, 103.5; the window (101, 111] holds the last three.
    assert tokens_in_window(r, now=111.0, span_s=10.0) == 3
    assert tokens_in_window(r, now=104.0, span_s=10.0) == 4
    assert tokens_in_window(r, now=200.0, span_s=10.0) == 0
    assert tokens_in_window(r, now=100.2, span_s=10.0) == 0  # none streamed yet


def test_backend_timelines_converts_a_finished_request_once() -> None:
    recorder = TimelineRecorder(capacity=4)
    asked: list[str] = []

    class Backend:
        timelines = recorder

        def timeline(self, rid: str) -> dict[str, Any] | None:
            asked.append(rid)
            return recorder.get(rid)

    done = recorder.open("done", "acme")
    done.on_output(RequestOutput("done", (1,), "x", "x", (1,), finished=True, finish_reason="stop",
                                 time=done.arrival + 0.001))
    live = recorder.open("live", "acme")
    live.on_output(RequestOutput("live", (1,), "x", "x", (1,), time=live.arrival + 0.001))
    source = BackendTimelines(Backend())
    for _ in range(3):
        assert [r.request_id for r in source.recent_records(10)] == ["live", "done"]
    assert asked.count("done") == 1 and asked.count("live") == 3
