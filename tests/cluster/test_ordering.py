"""Ordering: least slack first, fairness shares by weight, batch preempted first, TPOT cap."""

from __future__ import annotations

import pytest

from cluster.config import SchedulerConfig
from cluster.cost_model import StepCostPrior, StepTimeModel
from cluster.descriptors import SloClass, WorkerKind
from cluster.fairness import FairShareClock
from cluster.ordering import MinTracker, PriorityKey, SlackQueue, decode_batch_cap, priority_key
from cluster.placement import Placement, PlacementConfig
from cluster.tenants import BatchSlo, InteractiveSlo, TenantConfig
from cluster.timeline import Stage
from tests.cluster.helpers import R, T, desc, load, make


def test_slack_queue_pops_least_slack_first_and_supports_removal() -> None:
    q: SlackQueue[str] = SlackQueue()
    for item, key in [("c", 3.0), ("a", 1.0), ("d", 4.0), ("b", 2.0)]:
        q.push(item, PriorityKey(0, key, 0))
    q.push("batch", PriorityKey(1, 0.0, 0))  # any batch work sorts after all interactive work
    assert q.remove("b") and not q.remove("b")
    assert [q.pop()[0] for _ in range(4)] == ["a", "c", "d", "batch"]  # type: ignore[index]
    assert q.pop() is None and len(q) == 0


def test_scheduler_priorities_order_by_remaining_slack() -> None:
    cfg = SchedulerConfig(tenants=(
        TenantConfig(T("fast"), slo=InteractiveSlo(ttft_ms=200, tpot_ms=50)),
        TenantConfig(T("slow"), slo=InteractiveSlo(ttft_ms=2000, tpot_ms=50)),
        TenantConfig(T("bulk"), slo=BatchSlo(deadline_s=60)),
    ), fairness=False)
    sched, clock = make(cfg)
    out = {}
    out["slow0"] = sched.submit(desc("slow0", "slow", t=0.0))
    clock.advance(0.5)
    out["slow1"] = sched.submit(desc("slow1", "slow", t=0.5))
    out["fast"] = sched.submit(desc("fast", "fast", t=0.5))
    out["bulk"] = sched.submit(desc("bulk", "bulk", t=0.0))
    keys = {k: v.priority for k, v in out.items() if isinstance(v, Placement)}
    assert len(keys) == 4
    # Interactive slack is the time left to the TTFT deadline: 0.2 s for fast, 1.5 s and 2.0 s.
    assert keys["fast"].key_s == pytest.approx(0.7)
    assert keys["slow0"].key_s == pytest.approx(2.0)
    assert keys["slow1"].key_s == pytest.approx(2.5)
    # Batch: latest start = deadline - predicted prefill - expected output x decode step.
    assert keys["bulk"].class_rank == 1 and keys["bulk"].key_s < 60.0
    assert sorted(keys, key=keys.__getitem__) == ["fast", "slow0", "slow1", "bulk"]


def test_fairness_shares_follow_weights_under_contention() -> None:
    # Two tenants flood one server; it serves 1000 tokens per 0.01 s in priority order.
    fair = FairShareClock(reference_rate_tokens_per_s=1e5)
    q: SlackQueue[tuple[str, int]] = SlackQueue()
    weights = {"heavy": 3.0, "light": 1.0}
    served = {"heavy": 0.0, "light": 0.0}
    for t in weights:
        fair.activate(T(t), weights[t], 0.0)
    seq = 0
    now = 0.0
    backlog = {t: 0 for t in weights}
    for step in range(2000):
        for t in weights:  # both keep 20 requests of 1000 tokens queued at all times
            while backlog[t] < 20:
                lead = fair.tag(T(t), weights[t], 1000, now) - now
                q.push((t, seq), priority_key(SloClass.INTERACTIVE, now + 1.0, lead, seq))  # same SLO
                seq += 1
                backlog[t] += 1
        (tenant, _), _ = q.pop()  # type: ignore[misc]
        backlog[tenant] -= 1
        served[tenant] += 1000
        now += 0.01
    share = served["heavy"] / sum(served.values())
    assert share == pytest.approx(0.75, abs=0.075)  # within 10% of the weighted share


def test_a_flood_cannot_starve_a_light_tenant() -> None:
    slo = InteractiveSlo(ttft_ms=1e6, tpot_ms=50)
    cfg = SchedulerConfig(tenants=(TenantConfig(T("flood"), slo=slo), TenantConfig(T("calm"), slo=slo)),
                          reference_token_rate=10_000.0)
    sched, clock = make(cfg, prefill=1)
    floods = [sched.submit(desc(f"f{i}", "flood", prompt=1000, t=0.0)) for i in range(50)]
    calm = sched.submit(desc("c0", "calm", prompt=1000, t=0.0))
    assert all(isinstance(p, Placement) for p in floods) and isinstance(calm, Placement)
    earlier = [p for p in floods if isinstance(p, Placement) and p.priority < calm.priority]
    # The flooding tenant ran its counter ahead; only its first request (tag = now) precedes.
    assert len(earlier) <= 2
    assert sched.fairness.lead_s(T("flood"), clock.now()) > 1.0
    assert sched.fairness.lead_s(T("calm"), clock.now()) < 0.5


def test_tpot_cap_bounds_decode_batch_so_tightest_target_holds() -> None:
    model = StepTimeModel(StepCostPrior())
    # 5 ms + B * (0.032 ms + 2000 ctx x 34 ns = 0.068 ms): 50 ms x 0.85 allows 375 rows.
    assert decode_batch_cap(model, 0.05, 2000.0, 0.85, 1024) == 375
    assert decode_batch_cap(model, None, 2000.0, 0.85, 1024) == 1024
    assert decode_batch_cap(model, 0.004, 2000.0, 0.85, 1024) == 1  # below the fixed cost
    cfg = SchedulerConfig(default_tenant=TenantConfig(T("default"), slo=InteractiveSlo(1e6, 20.0)),
                          placement=PlacementConfig(decode_tpot_safety=1.0))
    sched, _ = make(cfg, prefill=1, decode=1)
    n = 0
    while True:
        p = sched.submit(desc(f"r{n}", prompt=2000, max_tokens=1))
        if not isinstance(p, Placement):
            break
        sched.on_stage(p.request_id, Stage.DECODE_ADMITTED)
        n += 1
    cap = sched.decode_batch_cap(R("d0"))  # type: ignore[arg-type]
    view = sched.workers.get(R("d0"))  # type: ignore[arg-type]
    assert view is not None and view.num_active == n == cap
    assert model.predict_decode_step(cap, cap * 2000) <= 0.020 < model.predict_decode_step(cap + 1, (cap + 1) * 2000)
    sched.check_integrity()


def test_interactive_work_preempts_batch_work_first_most_slack_first() -> None:
    cfg = SchedulerConfig(tenants=(
        TenantConfig(T("chat"), slo=InteractiveSlo(ttft_ms=1e6, tpot_ms=20.0)),
        TenantConfig(T("bulk"), slo=BatchSlo(deadline_s=1e5)),
    ), placement=PlacementConfig(decode_tpot_safety=1.0, default_output_tokens=1), heartbeat_timeout_s=1e6)
    sched, clock = make(cfg, prefill=1, decode=1)
    placed = []
    for i in range(3):  # batch rows, later ones with later deadlines (more slack)
        clock.advance(1.0)
        p = sched.submit(desc(f"b{i}", "bulk", prompt=2000, max_tokens=1, t=clock.now()))
        assert isinstance(p, Placement)
        sched.on_stage(p.request_id, Stage.DECODE_ADMITTED)
        placed.append(p)
    i = 0
    while True:  # fill the rest of the TPOT cap with interactive rows
        p = sched.submit(desc(f"c{i}", "chat", prompt=2000, max_tokens=1, t=clock.now()))
        assert isinstance(p, Placement)
        if p.preempt:
            break
        sched.on_stage(p.request_id, Stage.DECODE_ADMITTED)
        i += 1
    assert p.preempt == (R("b2"),)  # batch work, the one with the most slack
    assert sched.journal.get(R("b2")).phase.value == "preempted"  # type: ignore[union-attr]
    sched.on_stage(p.request_id, Stage.DECODE_ADMITTED)
    victims = []
    for j in range(2):
        m = sched.submit(desc(f"x{j}", "chat", prompt=2000, max_tokens=1, t=clock.now()))
        assert isinstance(m, Placement)
        sched.on_stage(m.request_id, Stage.DECODE_ADMITTED)
        victims.extend(m.preempt)
    assert victims == [R("b1"), R("b0")]  # then the next most slack; interactive never
    sched.check_integrity()
    # Capacity frees up: the preempted batch work resumes, most urgent (b0) first.
    for j in range(i + 1):
        sched.on_finish(R(f"c{j}"), num_output_tokens=1)
    resumed = sched.poll().resumed
    assert [r.request_id for r in resumed] == [R("b0"), R("b1"), R("b2")]
    assert {r.kind.value for r in resumed} == {"recompute"}
    sched.check_integrity()


def test_min_tracker_tracks_multiset_minimum() -> None:
    m = MinTracker()
    for v in (0.05, 0.02, 0.02, 0.1):
        m.add(v)
    assert m.min() == 0.02
    m.discard(0.02)
    assert m.min() == 0.02
    m.discard(0.02)
    assert m.min() == 0.05 and len(m) == 2
    for _ in range(1000):  # repeated churn must not grow the heap without bound
        m.add(0.07)
        m.discard(0.07)
    assert len(m._heap) < 32
    assert SloClass.INTERACTIVE.rank < SloClass.BATCH.rank
    assert WorkerKind.COLOCATED.serves_prefill and WorkerKind.COLOCATED.serves_decode
    assert load("x", WorkerKind.DECODE).num_free_blocks == 100_000
