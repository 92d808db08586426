"""Recovery journal, re-placement after a worker dies, heartbeats, and rebuild after a restart."""

from __future__ import annotations

import pytest

from cluster.clock import FakeClock
from cluster.config import SchedulerConfig
from cluster.descriptors import RequestId, SloClass, WorkerKind
from cluster.journal import Journal, JournalEntry, Phase, needs_prefill
from cluster.placement import Placement, PlacementKind
from cluster.scheduler import GlobalScheduler
from cluster.tenants import InteractiveSlo, TenantConfig
from cluster.timeline import Stage
from tests.cluster.helpers import R, T, W, desc, load, make


def _entry(rid: str, arrival: float, first: float | None, n_out: int, phase: Phase,
           prefill: str = "p0", decode: str = "d0") -> JournalEntry:
    return JournalEntry(desc(rid, t=arrival), SloClass.INTERACTIVE, arrival + 1.0, 0.05, None,
                        W(prefill), W(decode), phase, first_token_time=first, num_output_tokens=n_out)


def test_recovery_plan_orders_by_remaining_budget() -> None:
    j = Journal()
    j.add(_entry("queued_late", 9.5, None, 0, Phase.QUEUED))  # TTFT budget 0.5 s left at t=10
    j.add(_entry("queued_early", 9.2, None, 0, Phase.QUEUED))  # 0.2 s left
    j.add(_entry("decoding_ahead", 5.0, 5.5, 100, Phase.DECODING))  # next token due 5.5+5.0: 0.5 s
    j.add(_entry("decoding_behind", 5.0, 5.5, 80, Phase.DECODING))  # due 9.5: -0.5 s (late)
    j.add(_entry("elsewhere", 9.0, None, 0, Phase.QUEUED, prefill="p1", decode="d1"))
    plan = j.recovery_plan(W("d0"), now=10.0)
    assert [e.request_id for e in plan] == ["decoding_behind", "queued_early", "decoding_ahead", "queued_late"]
    # The predicted recompute cost counts against the budget: a long replay becomes more urgent.
    plan = j.recovery_plan(W("d0"), 10.0, recompute_s=lambda e: 0.4 if e.request_id == "decoding_ahead" else 0.0)
    assert [e.request_id for e in plan][:3] == ["decoding_behind", "decoding_ahead", "queued_early"]


def test_needs_prefill_distinguishes_lost_kv_from_a_lost_destination() -> None:
    assert needs_prefill(_entry("a", 0, None, 0, Phase.PREFILLING), W("p0"))
    assert not needs_prefill(_entry("a", 0, None, 0, Phase.PREFILLING), W("d0"))
    assert needs_prefill(_entry("a", 0, 1, 3, Phase.TRANSFERRING), W("p0"))
    assert not needs_prefill(_entry("a", 0, 1, 3, Phase.TRANSFERRING), W("d0"))  # sender still holds it
    assert needs_prefill(_entry("a", 0, 1, 3, Phase.DECODING), W("d0"))


def _placed(n: int) -> tuple[GlobalScheduler, FakeClock, dict[RequestId, Placement]]:
    """A 2P+2D scheduler with `n` 500-token requests placed 10 ms apart."""
    cfg = SchedulerConfig(default_tenant=TenantConfig(T("default"), slo=InteractiveSlo(1000, 50)),
                          heartbeat_timeout_s=1e6)
    sched, clock = make(cfg, prefill=2, decode=2)
    ps = {}
    for i in range(n):
        p = sched.submit(desc(f"r{i}", prompt=500, t=clock.now()))
        assert isinstance(p, Placement)
        ps[p.request_id] = p
        clock.advance(0.01)
    return sched, clock, ps


def test_decode_death_replaces_requests_most_urgent_first_with_resume_points() -> None:
    sched, clock, ps = _placed(8)
    on_d0 = sorted(r for r, p in ps.items() if p.decode_worker == "d0")
    assert len(on_d0) == 4
    # Two of d0's requests are decoding with different progress; two are still prefilling.
    for rid, n in ((on_d0[0], 30), (on_d0[1], 10)):
        sched.on_token(rid)
        sched.on_stage(rid, Stage.DECODE_ADMITTED)
        sched.on_token(rid, token_ids=tuple(range(n - 1)))
    clock.set(1.0)
    out = sched.on_worker_dead(W("d0"))
    assert all(isinstance(p, Placement) for p in out)
    got = [(p.request_id, p.kind, p.resume_from_token, p.decode_worker) for p in out]  # type: ignore[union-attr]
    # Budgets at t=1: on_d0[1] next token due 0.04 + 10 x 0.05 = 0.54 (late), on_d0[0] 1.54;
    # the queued ones have TTFT deadlines ~1.02-1.06.
    assert got[0] == (on_d0[1], PlacementKind.RECOMPUTE, 10, "d1")
    assert [g[0] for g in got[1:3]] == on_d0[2:]
    assert all(g[1] is PlacementKind.REDIRECT and g[2] == 0 for g in got[1:3])
    assert got[3] == (on_d0[0], PlacementKind.RECOMPUTE, 30, "d1")
    assert sched.journal.get(on_d0[1]).output_token_ids == list(range(9))  # type: ignore[union-attr]
    assert sched.stats().num_recovered == 4 and sched.stats().num_workers_lost == 1
    sched.check_integrity()
    for rid in ps:
        sched.on_finish(rid)
    sched.check_integrity()
    assert sched.stats().num_in_flight == 0
    view = sched.workers.get(W("d1"))
    assert view is not None and (view.num_active, view.num_committed, view.active_blocks) == (0, 0, 0)


def test_missed_heartbeats_declare_a_worker_dead_in_poll() -> None:
    sched, clock = make(SchedulerConfig(heartbeat_timeout_s=2.0), prefill=2, decode=1)
    p = sched.submit(desc("a"))
    assert isinstance(p, Placement)
    clock.advance(1.5)
    for w, kind in (("p0", WorkerKind.PREFILL), ("p1", WorkerKind.PREFILL), ("d0", WorkerKind.DECODE)):
        if w != p.prefill_worker:
            sched.on_report(load(w, kind))
    assert sched.poll().recovered == []
    clock.advance(0.6)  # the silent worker has now missed 2.1 s of reports
    recovered = sched.poll().recovered
    assert [(r.request_id, r.kind) for r in recovered] == [("a", PlacementKind.RECOMPUTE)]  # type: ignore[union-attr]
    assert recovered[0].prefill_worker != p.prefill_worker  # type: ignore[union-attr]
    assert sched.workers.get(p.prefill_worker) is None


def test_rebuild_after_scheduler_restart_keeps_accounts_and_replaces_orphans() -> None:
    cfg = SchedulerConfig(heartbeat_timeout_s=1e6)
    sched, clock = make(cfg, prefill=2, decode=2)
    for i in range(6):
        p = sched.submit(desc(f"r{i}", prompt=800))
        assert isinstance(p, Placement)
    sched.on_token(R("r0"))
    sched.on_stage(R("r0"), Stage.DECODE_ADMITTED)
    sched.on_token(R("r0"), count=4)
    snap = sched.snapshot()
    in_flight = [JournalEntry.from_dict(d) for d in snap["journal"]]
    assert [e.request_id for e in in_flight] == [f"r{i}" for i in range(6)]
    # The new scheduler hears from every worker except d1 (it died with the old scheduler).
    loads = [load("p0", WorkerKind.PREFILL), load("p1", WorkerKind.PREFILL), load("d0", WorkerKind.DECODE)]
    on_d1 = sorted(e.request_id for e in in_flight if e.decode_worker == "d1")
    assert len(on_d1) == 3
    new, replaced = GlobalScheduler.rebuild(cfg, clock, in_flight, loads, snap["fairness"])
    assert sorted(p.request_id for p in replaced) == on_d1
    assert all(isinstance(p, Placement) and p.decode_worker == "d0" for p in replaced)
    assert new.stats().num_in_flight == 6
    assert new.journal.get(R("r0")).num_output_tokens == 5  # type: ignore[union-attr]
    new.check_integrity()
    d0 = new.workers.get(W("d0"))
    assert d0 is not None and d0.num_active + d0.num_committed == 6
    for i in range(6):
        new.on_finish(R(f"r{i}"))
    new.check_integrity()
    assert (d0.num_active, d0.num_committed, d0.active_blocks, d0.committed_blocks) == (0, 0, 0, 0)
    assert new.fairness.served_tokens(T("default")) == pytest.approx(sched.fairness.served_tokens(T("default")))


def test_a_prefill_death_leaves_requests_already_decoding_elsewhere_alone() -> None:
    sched, clock, ps = _placed(6)
    on_p0 = sorted(r for r, p in ps.items() if p.prefill_worker == "p0")
    assert len(on_p0) >= 2
    decoding, queued = on_p0[0], on_p0[1:]
    sched.on_token(decoding)
    sched.on_stage(decoding, Stage.DECODE_ADMITTED)
    sched.on_token(decoding, count=5)
    before = sched.journal.get(decoding)
    assert before is not None and before.phase is Phase.DECODING
    decode_at = before.decode_worker
    view = sched.workers.get(decode_at)
    assert view is not None
    rows_before = (view.num_active, view.num_committed, view.active_blocks, view.committed_blocks)
    out = sched.on_worker_dead(W("p0"))
    # Only the requests whose prompt KV died are placed again; the decoding one is not touched.
    assert sorted(p.request_id for p in out) == queued
    assert all(isinstance(p, Placement) and p.kind is PlacementKind.RECOMPUTE for p in out)
    after = sched.journal.get(decoding)
    assert after is not None and (after.phase, after.decode_worker, after.num_recoveries) == (Phase.DECODING, decode_at, 0)
    assert sched.stats().num_recovered == len(queued)
    sched.check_integrity()
    # Its decode worker still carries it (the queued ones may have been re-placed there too).
    assert view.num_active >= rows_before[0] and view.active_blocks >= rows_before[2]
    for rid in ps:
        sched.on_finish(rid)
    sched.check_integrity()
    assert sched.stats().num_in_flight == 0
