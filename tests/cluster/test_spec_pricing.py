"""Speculative decoding in the scheduler's decode pricing: a worker's measured tokens per decode
row-step, over every decode row-step (speculating or not)."""

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


def _report(rows: int | None, accepted: int, name: str = "d0", rounds: int | None = None):  # type: ignore[no-untyped-def]
    rounds = (rows or 0) if rounds is None else rounds
    return replace(load(name, WorkerKind.DECODE), num_decode_rows=rows, num_spec_rounds=rounds,
                   num_accepted_tokens=accepted)


def test_tokens_per_step_follows_the_rows_since_the_last_report() -> None:
    sched, _ = make(prefill=1, decode=1)
    view = sched.workers.get(W("d0"))
    assert view is not None and view.tokens_per_step == 1.0  # never speculated
    sched.on_report(_report(0, 0))
    assert view.tokens_per_step == 1.0
    sched.on_report(_report(100, 150))  # the first rows: taken as measured
    assert view.tokens_per_step == pytest.approx(2.5)
    sched.on_report(_report(200, 200))  # 100 rows, 50 accepted: 1.5, smoothed with 2.5
    assert view.tokens_per_step == pytest.approx(2.0)
    sched.on_report(_report(200, 200))  # no rows since: nothing new to learn
    assert view.tokens_per_step == pytest.approx(2.0)
    sched.on_report(_report(10, 5))  # counters went back: a restarted worker, counted from 0
    assert view.tokens_per_step == pytest.approx(1.75)
    assert view.spec_counters == (10, 5)


def test_a_worker_whose_rows_rarely_speculate_is_priced_near_one_token_per_row_step() -> None:
    # Batch 16, 400 steps: 6,400 decode row-steps, of which 10 verified drafts (9 accepted). Per
    # verifying row that is 1.9 tokens; per decode row-step, what every row's TPOT sees, ~1.0014.
    sched, _ = make(prefill=1, decode=1)
    view = sched.workers.get(W("d0"))
    assert view is not None
    sched.on_report(_report(16 * 400, 9, rounds=10))
    assert view.tokens_per_step == pytest.approx(1 + 9 / 6400)
    assert view.tokens_per_step < 1.01


@pytest.mark.parametrize("rows", [None, 0])
def test_a_report_without_decode_rows_prices_one_token_per_row_step(rows) -> None:  # type: ignore[no-untyped-def]
    sched, _ = make(prefill=1, decode=1)
    view = sched.workers.get(W("d0"))
    assert view is not None
    sched.on_report(_report(100, 150))
    assert view.tokens_per_step == pytest.approx(2.5)
    sched.on_report(_report(rows, 300, rounds=200))  # an older worker: rounds and acceptances only
    assert view.tokens_per_step == 1.0 and view.spec_counters is None


def _sched_with_a_row(rows: int, accepted: int):  # type: ignore[no-untyped-def]
    slo = InteractiveSlo(ttft_ms=1e6, tpot_ms=5.0)  # tighter than a step with two rows (prior: ~5.1 ms)
    cfg = SchedulerConfig(default_tenant=TenantConfig(T("default"), slo=slo), heartbeat_timeout_s=1e6,
                          slo_admission=False)
    sched, _ = make(cfg, prefill=1, decode=1)
    sched.on_report(_report(rows, accepted))
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
