"""Admission: named refusals with exact retry-after, and nothing queued forever."""

from __future__ import annotations

import pytest

from cluster.admission import AdmissionConfig, Refusal, RefusalReason
from cluster.config import SchedulerConfig
from cluster.placement import Placement
from cluster.tenants import BatchSlo, InteractiveSlo, TenantConfig, TokenBucket
from cluster.timeline import Stage
from tests.cluster.helpers import R, T, W, desc, make


def test_token_bucket_refills_and_goes_into_debt() -> None:
    b = TokenBucket(rate_per_s=100.0, capacity=1000.0, now=0.0)
    assert b.wait_s(1000, 0.0) == 0.0
    b.take(1000, 0.0)
    assert b.wait_s(300, 0.0) == pytest.approx(3.0)
    assert b.wait_s(300, 2.0) == pytest.approx(1.0)
    b.take(500, 2.0)  # 200 available, 500 taken: 300 in debt
    assert b.level(2.0) == pytest.approx(-300.0)
    assert b.wait_s(1001, 2.0) == float("inf")


def test_token_rate_exhaustion_refuses_with_reason_and_retry_after() -> None:
    cfg = SchedulerConfig(tenants=(TenantConfig(T("a"), max_tokens_per_s=1000.0, burst_tokens=2000.0),))
    sched, clock = make(cfg)
    assert isinstance(sched.submit(desc("r1", "a", prompt=1500)), Placement)
    out = sched.submit(desc("r2", "a", prompt=1000))
    assert isinstance(out, Refusal)
    assert out.reason is RefusalReason.TOKEN_RATE and out.reason.http_status == 429
    assert out.retry_after_s == pytest.approx(0.5)  # 500 tokens left, 500 missing at 1000/s
    clock.advance(0.5)
    assert isinstance(sched.submit(desc("r2b", "a", prompt=1000, t=0.5)), Placement)
    # Generated tokens are charged at finish, driving the bucket into debt.
    sched.on_finish(R("r1"), num_output_tokens=1000)
    out = sched.submit(desc("r3", "a", prompt=100, t=0.5))
    assert isinstance(out, Refusal) and out.reason is RefusalReason.TOKEN_RATE
    assert out.retry_after_s == pytest.approx(1.1)  # level -1000, needs +100
    assert sched.stats().num_refused == {"token_rate": 2}


def test_concurrency_and_size_refusals() -> None:
    cfg = SchedulerConfig(tenants=(TenantConfig(T("a"), max_concurrency=2, max_tokens_per_s=10.0,
                                                burst_tokens=5000.0),),
                          admission=AdmissionConfig(max_model_len=4096), default_tenant=None)
    sched, clock = make(cfg)
    assert isinstance(sched.submit(desc("r1", "a", prompt=100)), Placement)
    assert isinstance(sched.submit(desc("r2", "a", prompt=100)), Placement)
    out = sched.submit(desc("r3", "a", prompt=100))
    assert isinstance(out, Refusal) and out.reason is RefusalReason.CONCURRENCY
    assert out.retry_after_s == pytest.approx(1.0)  # no finished request yet: the configured hint
    clock.advance(2.0)
    sched.on_finish(R("r1"), num_output_tokens=0)  # 2 s per request, 2 slots: one frees every 1 s
    sched.on_finish(R("r2"), num_output_tokens=0)
    big = sched.submit(desc("r4", "a", prompt=4000, max_tokens=200, t=2.0))
    assert isinstance(big, Refusal) and big.reason is RefusalReason.REQUEST_TOO_LARGE
    assert big.retry_after_s is None and big.reason.http_status == 413
    assert isinstance(sched.submit(desc("r5", "a", prompt=3000, t=2.0)), Placement)  # 4820 left
    debt = sched.submit(desc("r6", "a", prompt=3000, t=2.0))  # 1820 left: 118 s away, clamped
    assert isinstance(debt, Refusal) and debt.reason is RefusalReason.TOKEN_RATE
    assert debt.retry_after_s == 60.0
    assert isinstance(sched.submit(desc("r7", "a", prompt=100, t=2.0)), Placement)
    busy = sched.submit(desc("r8", "a", prompt=100, t=2.0))
    assert isinstance(busy, Refusal) and busy.reason is RefusalReason.CONCURRENCY
    assert busy.retry_after_s == pytest.approx(1.0)  # mean duration 2 s over 2 slots
    over = sched.submit(desc("r9", "zzz"))
    assert isinstance(over, Refusal) and over.reason is RefusalReason.UNKNOWN_TENANT
    assert over.retry_after_s is None


def test_predicted_slo_miss_is_refused_early_with_the_excess_as_retry_after() -> None:
    cfg = SchedulerConfig(default_tenant=TenantConfig(T("default"), slo=InteractiveSlo(ttft_ms=300, tpot_ms=50)))
    sched, _ = make(cfg, prefill=1)
    placed = [sched.submit(desc(f"r{i}", prompt=2500)) for i in range(10)]
    first_refusal = next(i for i, p in enumerate(placed) if isinstance(p, Refusal))
    # Prior model: 5 ms + 90 ms (36 us/token) + 3.75 ms attention = 98.75 ms a prompt: 3 fit in 300 ms.
    assert first_refusal == 3
    refusal = placed[3]
    assert isinstance(refusal, Refusal) and refusal.reason is RefusalReason.SLO_UNATTAINABLE
    p2 = placed[2]
    assert isinstance(p2, Placement) and p2.predicted_ttft_s == pytest.approx(3 * 0.09875)
    assert refusal.retry_after_s == pytest.approx(4 * p2.predicted_ttft_s / 3 - 0.3, rel=1e-6)
    # the three ahead of it are its predicted wait, and the prediction is in the detail
    assert refusal.predicted_wait_s == pytest.approx(3 * 0.09875, rel=1e-6)
    assert refusal.detail == "predicted TTFT 395 ms (after 296 ms queued) > target 300 ms"


def test_batch_deadline_refusal_and_no_refusal_when_disabled() -> None:
    slo = BatchSlo(deadline_s=0.5)
    sched, _ = make(SchedulerConfig(default_tenant=TenantConfig(T("default"), slo=slo)))
    out = sched.submit(desc("b", prompt=100, max_tokens=4096))  # 4096 decode steps > 0.5 s
    assert isinstance(out, Refusal) and out.reason is RefusalReason.SLO_UNATTAINABLE
    sched2, _ = make(SchedulerConfig(default_tenant=TenantConfig(T("default"), slo=slo), slo_admission=False))
    assert isinstance(sched2.submit(desc("b", prompt=100, max_tokens=4096)), Placement)


def test_queue_timeout_expires_requests_that_never_started() -> None:
    cfg = SchedulerConfig(default_tenant=TenantConfig(T("default"), queue_timeout_s=5.0), heartbeat_timeout_s=60.0)
    sched, clock = make(cfg)
    for rid in ("a", "b"):
        assert isinstance(sched.submit(desc(rid)), Placement)
    sched.on_stage(R("b"), Stage.PREFILL_START)  # b started: it is no longer queued
    clock.advance(4.99)
    assert sched.poll().expired == []
    clock.advance(0.02)
    expired = sched.poll().expired
    assert [(r.request_id, r.reason) for r in expired] == [("a", RefusalReason.QUEUE_TIMEOUT)]
    assert sched.stats().num_in_flight == 1 and sched.stats().num_expired == 1
    assert sched.timeline(R("a"))["stamps"]["refused"] == pytest.approx(5.01)  # type: ignore[index]
    sched.check_integrity()


def test_a_tenant_whose_contract_says_queue_is_never_refused_for_a_predicted_miss() -> None:
    tenant = TenantConfig(T("default"), slo=InteractiveSlo(ttft_ms=300, tpot_ms=50), shed_predicted_misses=False)
    sched, _ = make(SchedulerConfig(default_tenant=tenant), prefill=1)
    placed = [sched.submit(desc(f"r{i}", prompt=2500)) for i in range(10)]
    assert all(isinstance(p, Placement) for p in placed)  # the shedding tenant above refuses from the 4th
    assert placed[-1].predicted_ttft_s > 0.3  # admitted knowing it will be late


def test_a_miss_the_request_would_have_even_alone_is_not_shed() -> None:
    # A 9,000-token prompt alone takes 5 ms + 324 ms + 48.6 ms attention under the prior: over
    # 2 x 150 ms with nothing queued, so no load is to blame and refusing frees nothing: admitted.
    tenant = TenantConfig(T("default"), slo=InteractiveSlo(ttft_ms=150, tpot_ms=50))
    sched, _ = make(SchedulerConfig(default_tenant=tenant), prefill=1)
    alone = sched.submit(desc("big", prompt=9000))
    assert isinstance(alone, Placement) and alone.predicted_ttft_s > 0.3
    # A short prompt queued behind it misses because of that load: shed, as before.
    behind = sched.submit(desc("small", prompt=100))
    assert isinstance(behind, Refusal) and behind.reason is RefusalReason.SLO_UNATTAINABLE


def test_a_cold_step_model_that_overpredicts_a_lone_row_does_not_refuse_every_request() -> None:
    # What a CPU decode worker reports after a few local prefills of long prompts beside the
    # prefill worker: six ~1 s steps of 512 prefill tokens, one 40 ms decode step. Fitted
    # against the GPU prior, most of the prefill time lands on the intercept, so a lone decode
    # row is predicted at ~0.3-0.5 s, over 2x a 200 ms TPOT target. Before, every new request
    # was refused on that prediction, so the model never got the decode steps that correct it.
    from cluster.descriptors import StepSample, WorkerKind

    from tests.cluster.helpers import load

    tenant = TenantConfig(T("default"), slo=InteractiveSlo(ttft_ms=3000, tpot_ms=200))
    sched, _ = make(SchedulerConfig(default_tenant=tenant, heartbeat_timeout_s=1e6), prefill=1, decode=1)
    steps = tuple(StepSample(512, 512 * 256.0, 0, 0, 1.0) for _ in range(6)) + (StepSample(0, 0.0, 1, 1000, 0.04),)
    sched.on_report(load("d0", WorkerKind.DECODE, steps=steps))
    alone = sched.models.get(W("d0")).predict_decode_step(1, 1000)
    assert alone > 0.4  # the over-prediction itself
    placed = [sched.submit(desc(f"r{i}", prompt=1000, max_tokens=2)) for i in range(4)]
    assert all(isinstance(p, Placement) for p in placed)
