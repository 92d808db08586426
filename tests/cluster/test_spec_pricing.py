"""Speculative decoding in the scheduler's decode pricing: a worker's measured tokens per step and row."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.config import SchedulerConfig
from cluster.descriptors import WorkerKind
from cluster.placement import Placement
from cluster.scaling import decode_pressure
from cluster.tenants import InteractiveSlo, TenantConfig
from cluster.timeline import Stage
from tests.cluster.helpers import R, T, W, desc, load, make


def _report(rounds: int, accepted: int, name: str = "d0"):  # type: ignore[no-untyped-def]
    return replace(load(name, WorkerKind.DECODE), num_spec_rounds=rounds, num_accepted_tokens=accepted)


def test_tokens_per_step_follows_the_rounds_since_the_last_report() -> None:
    sched, _ = make(prefill=1, decode=1)
    view = sched.workers.get(W("d0"))
    assert view is not None and view.tokens_per_step == 1.0  # never speculated
    sched.on_report(_report(0, 0))
    assert view.tokens_per_step == 1.0
    sched.on_report(_report(100, 150))  # the first rounds: taken as measured
    assert view.tokens_per_step == pytest.approx(2.5)
    sched.on_report(_report(200, 200))  # 100 rounds, 50 accepted: 1.5, smoothed with 2.5
    assert view.tokens_per_step == pytest.approx(2.0)
    sched.on_report(_report(200, 200))  # no rounds since: nothing new to learn
    assert view.tokens_per_step == pytest.approx(2.0)
    sched.on_report(_report(10, 5))  # counters went back: a restarted worker, counted from 0
    assert view.tokens_per_step == pytest.approx(1.75)
    assert view.spec_counters == (10, 5)


def _sched_with_a_row(rounds: int, accepted: int):  # type: ignore[no-untyped-def]
    slo = InteractiveSlo(ttft_ms=1e6, tpot_ms=5.0)  # tighter than a step with two rows (prior: ~5.1 ms)
    cfg = SchedulerConfig(default_tenant=TenantConfig(T("default"), slo=slo), heartbeat_timeout_s=1e6,
                          slo_admission=False)
    sched, _ = make(cfg, prefill=1, decode=1)
    sched.on_report(_report(rounds, accepted))
    first = sched.submit(desc("r0", prompt=512))
    assert isinstance(first, Placement) and first.decode_worker == "d0"  # a lone row always fits
    sched.on_stage(R("r0"), Stage.DECODE_ADMITTED)
    return sched


def test_a_speculating_workers_tpot_is_its_step_over_its_tokens_per_step() -> None:
    plain, spec = _sched_with_a_row(0, 0), _sched_with_a_row(100, 100)  # 2 tokens per step and row
    args = (0.005, True, 512 + 64, 512, 64)
    a = plain.policy.choose_decode(*args, plain.workers.decode)
    b = spec.policy.choose_decode(*args, spec.workers.decode)
    assert a is not None and b is not None
    assert b.step_s == pytest.approx(a.step_s / 2)
    # A second row makes the step ~5.1 ms: over 0.85 x 5 ms per token without speculation (the
    # row waits for one to free), within it at 2 tokens a step.
    assert not a.feasible and a.wait_s > 0
    assert b.feasible
    # The placement's predicted TPOT is that per-token time.
    p = spec.submit(desc("r1", prompt=512))
    assert isinstance(p, Placement) and p.predicted_tpot_s == pytest.approx(b.step_s)


def test_decode_pressure_prices_the_step_per_token() -> None:
    plain, spec = _sched_with_a_row(0, 0), _sched_with_a_row(100, 300)  # 4 tokens per step and row
    assert decode_pressure(spec.workers) == pytest.approx(decode_pressure(plain.workers) / 4)
    assert decode_pressure(plain.workers) > 1  # one row's step alone is over its 5 ms target
