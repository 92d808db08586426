"""Builders shared by the cluster tests: a scheduler on a fake clock with a few reporting workers."""

from __future__ import annotations

from cluster.clock import FakeClock
from cluster.config import SchedulerConfig
from cluster.descriptors import (RequestDesc, RequestId, SloClass, StepSample, TenantId, WorkerKind, WorkerReport,
                                 WorkerName)
from cluster.scheduler import GlobalScheduler

W = WorkerName
R = RequestId
T = TenantId


def load(name: str, kind: WorkerKind, *, free: int = 100_000, total: int = 100_000, t: float = 0.0,
         steps: tuple[StepSample, ...] = (), added: tuple[int, ...] = ()) -> WorkerReport:
    return WorkerReport(W(name), kind, 0, 0, free, total, 16, True, t, steps, cached_added=added)


def make(cfg: SchedulerConfig | None = None, *, prefill: int = 2, decode: int = 2,
         decode_blocks: int = 100_000) -> tuple[GlobalScheduler, FakeClock]:
    clock = FakeClock()
    sched = GlobalScheduler(cfg or SchedulerConfig(), clock)
    for i in range(prefill):
        sched.on_report(load(f"p{i}", WorkerKind.PREFILL))
    for i in range(decode):
        sched.on_report(load(f"d{i}", WorkerKind.DECODE, free=decode_blocks, total=decode_blocks))
    return sched, clock


def desc(rid: str, tenant: str = "default", prompt: int = 512, max_tokens: int = 64, *, t: float = 0.0,
         hashes: tuple[int, ...] = (), slo_class: SloClass | None = None) -> RequestDesc:
    return RequestDesc(R(rid), T(tenant), prompt, max_tokens, hashes, t, slo_class)
