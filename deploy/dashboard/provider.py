"""`TimelineDashboard`: the dashboard's figures computed in the ingress, and the sources it reads.

Mental model: a provider joins four feeds, each behind a small protocol so any part of the system
can supply it: recent request records (`TimelineSource`: the HTTP backend's timelines today, the
cluster scheduler's later), worker loads (`LoadSource`: `Router.loads` as it is, or one
in-process engine), cumulative cache counters (`PrefixSource`) and refusal counts
(`RefusalSource`: `deploy.metrics.RequestMetrics`), plus the tenants' SLOs (`SloSource`). Each
poll reads them once and hands the numbers to the pure functions of window.py. The window is
bounded by the source too: a recorder that keeps 1024 requests covers less than a minute under
heavy load (then the figures are over those requests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from actors.colocated import process_rss_bytes
from actors.engine.output import EngineStats
from actors.messages import WorkerKind, WorkerLoad
from deploy.dashboard.experts import ExpertSource, ExpertWindow
from deploy.dashboard.model import (DashboardData, RequestBar, SloTargets, TenantFigures, Throughput,
                                    TierFigures, WorkerFigures)
from deploy.dashboard.records import RequestRecord, record_from_timeline
from deploy.dashboard.window import (CounterWindow, HitCount, attainment, count_rate, hit_rate, in_window,
                                     percentile, window_span_s)

logger = logging.getLogger(__name__)

SOURCE_TIMEOUT_S = 2.0  # a poll every ~2 s must not pile up behind a slow worker


class TimelineSource(Protocol):
    def recent_records(self, limit: int) -> list[RequestRecord]:
        """Up to `limit` most recent requests, running ones included, newest first."""
        ...


class LoadSource(Protocol):
    async def loads(self) -> Mapping[str, WorkerLoad]: ...


class PrefixSource(Protocol):
    async def prefix_counts(self) -> Mapping[str, HitCount]:
        """Cumulative hits/lookups per tier name since each counter's worker started."""
        ...


class SloSource(Protocol):
    def slo(self, tenant: str) -> SloTargets | None: ...

    def known_tenants(self) -> Iterable[str]:
        """Tenants shown even before their first request."""
        ...


class RefusalSource(Protocol):
    def refusals(self) -> Mapping[str, int]:
        """Cumulative refusals by reason."""
        ...


class StaticSlos:
    """SLOs from configuration: tenant -> anything with `ttft_ms` and `tpot_ms` (an `SloTargets`, the
    scheduler's `InteractiveSlo`, or a dict from YAML); other values (a `BatchSlo`) mean no latency
    promise. `default` is the contract of every tenant not listed, as the scheduler's default tenant
    is (None: they have none)."""

    def __init__(self, targets: Mapping[str, Any], default: Any = None) -> None:
        self._targets = dict(targets)
        self._default = default

    def slo(self, tenant: str) -> SloTargets | None:
        t = self._targets.get(tenant, self._default)
        get = t.get if isinstance(t, Mapping) else (lambda key: getattr(t, key, None))
        ttft, tpot = get("ttft_ms"), get("tpot_ms")
        return None if ttft is None or tpot is None else SloTargets(float(ttft), float(tpot))

    def known_tenants(self) -> Iterable[str]:
        return self._targets.keys()


class BackendTimelines:
    """`TimelineSource` over an HTTP backend (EngineBackend, ClusterBackend): request ids from its
    `TimelineRecorder`, each timeline from `backend.timeline(id)` (which adds the prefill report).
    A finished request's record never changes, so it is converted once and kept while the
    recorder still holds the request: a poll costs O(running requests), not O(tokens kept)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._finished: dict[str, RequestRecord] = {}

    def recent_records(self, limit: int) -> list[RequestRecord]:
        held = self.backend.timelines.request_ids()
        out = []
        for rid in reversed(held[-limit:]):
            record = self._finished.get(rid)
            if record is None:
                data = self.backend.timeline(rid)
                if data is None:
                    continue
                record = record_from_timeline(data)
                if record.finished:
                    self._finished[rid] = record
            out.append(record)
        if len(self._finished) > len(held):  # forget what the recorder dropped
            keep = set(held)
            self._finished = {rid: r for rid, r in self._finished.items() if rid in keep}
        return out


def load_of_engine(name: str, stats: EngineStats, *, healthy: bool, kind: WorkerKind = "colocated") -> WorkerLoad:
    """The load of an engine running in this process (its memory is this process's)."""
    return WorkerLoad(name, kind, stats.num_running, stats.num_waiting, 0, stats.num_blocks_free,
                      stats.num_blocks_total, stats.last_step_s, healthy, process_rss_bytes(),
                      kv_blocks_by_tenant=stats.kv_blocks_by_tenant, offloaded_bytes=stats.offloaded_bytes,
                      spec_method=stats.spec_method, num_draft_tokens=stats.num_draft_tokens,
                      num_accepted_tokens=stats.num_accepted_tokens, num_spec_rounds=stats.num_spec_rounds,
                      num_decode_rows=stats.num_decode_rows)


class EngineSource:
    """`LoadSource` and `PrefixSource` over one in-process `AsyncEngine` (the colocated backend)."""

    def __init__(self, async_engine: Any, name: str = "engine-0") -> None:
        self.async_engine = async_engine
        self.name = name

    async def stats(self) -> EngineStats:
        return await asyncio.to_thread(self.async_engine.stats)  # takes the engine lock: <= one step

    async def loads(self) -> Mapping[str, WorkerLoad]:
        stats = await self.stats()
        return {self.name: load_of_engine(self.name, stats, healthy=self.async_engine.is_alive)}

    async def prefix_counts(self) -> Mapping[str, HitCount]:
        stats = await self.stats()
        return {"hbm": HitCount(stats.num_prefix_hit_tokens, stats.num_prefix_queried_tokens)}


@dataclass(frozen=True)
class DashboardSources:
    timelines: TimelineSource
    loads: LoadSource | None = None
    prefix: PrefixSource | None = None
    slos: SloSource | None = None
    refusals: RefusalSource | None = None
    experts: ExpertSource | None = None


def tokens_in_window(r: RequestRecord, now: float, span_s: float) -> int:
    """Output tokens of `r` streamed inside (now - span_s, now]; most requests lie wholly inside
    or outside the window, and are counted without looking at each token."""
    if not r.token_ms:
        return 0
    first, last = r.arrival_unix_s + r.token_ms[0] / 1e3, r.arrival_unix_s + r.token_ms[-1] / 1e3
    if in_window(first, now, span_s) and in_window(last, now, span_s):
        return len(r.token_ms)
    if last <= now - span_s or first > now:
        return 0
    return sum(1 for t in r.token_unix_s() if in_window(t, now, span_s))


def timeline_tiers(records: Iterable[RequestRecord]) -> dict[str, HitCount]:
    """Prompt tokens served from each tier. A prefill report splits its reused tokens between the
    prefill engine's blocks (hbm) and the pool in proportion to the blocks each supplied."""
    hits: dict[str, int] = {}
    prompt = 0
    for r in records:
        prompt += r.num_prompt_tokens
        p = r.prefill
        if p is None:
            hits["hbm"] = hits.get("hbm", 0) + r.num_cached_tokens
            continue
        reused = max(0, r.num_prompt_tokens - p.num_computed_tokens)
        blocks = p.num_local_hit_blocks + p.num_pool_hit_blocks
        local = round(reused * p.num_local_hit_blocks / blocks) if blocks else 0
        hits["hbm"] = hits.get("hbm", 0) + local
        hits["pool"] = hits.get("pool", 0) + reused - local  # a tier shown only where prefills report
    return {tier: HitCount(min(n, prompt), prompt) for tier, n in hits.items()}


class TimelineDashboard:
    """`DashboardProvider` over `DashboardSources`; latency percentiles over the last `window_s`."""

    def __init__(self, sources: DashboardSources, *, window_s: float = 60.0, max_records: int = 1024,
                 num_recent: int = 24, clock: Callable[[], float] = time.time) -> None:
        self.sources = sources
        self.window_s = window_s
        self.max_records = max_records
        self.num_recent = num_recent
        self.clock = clock
        self.started_at = clock()
        self._counters: dict[str, CounterWindow] = defaultdict(lambda: CounterWindow(window_s, self.started_at))
        self._experts = ExpertWindow()

    def _window(self, now: float) -> tuple[list[RequestRecord], list[RequestRecord], float]:
        """The recent records, those of them completed inside the window, and the window's span."""
        records = self.sources.timelines.recent_records(self.max_records)
        span = window_span_s(now, self.window_s, self.started_at)
        done = [r for r in records if r.completed and r.finish_unix_s is not None
                and in_window(r.finish_unix_s, now, span)]
        return records, done, span

    def slo_report(self) -> dict[str, Any]:
        """What `/health` reports under `slo` (and `ferry status` prints): per tenant, its P99 targets
        (None for a tenant without a latency promise), the requests completed in the window, the
        fraction of them that met both targets (None before the first) and the P99s measured. Reads
        only the ingress's own timelines: no call to any worker."""
        records, done, span = self._window(self.clock())
        tenants = {}
        for t in self._tenants(records, done):
            tenants[t.tenant] = {
                "ttft_slo_ms": None if t.slo is None else t.slo.ttft_ms,
                "tpot_slo_ms": None if t.slo is None else t.slo.tpot_ms,
                "completed": t.num_completed, "running": t.num_running, "attainment": t.slo_attainment,
                "ttft_p99_ms": t.ttft_p99_ms, "tpot_p99_ms": t.tpot_p99_ms,
            }
        return {"window_s": span, "tenants": tenants}

    async def dashboard_data(self) -> DashboardData:
        now = self.clock()
        notes: list[str] = []
        records, done, span = self._window(now)
        num_tokens = sum(tokens_in_window(r, now, span) for r in records)
        finishes = [r.finish_unix_s for r in done if r.finish_unix_s is not None]
        throughput = Throughput(span, len(done), num_tokens, count_rate(finishes, now, span),
                                num_tokens / span if span > 0 else 0.0)
        loads = await self._read("worker loads", self.sources.loads, "loads", notes) or {}
        counts = await self._read("prefix counters", self.sources.prefix, "prefix_counts", notes) or {}
        tiers = dict(timeline_tiers(done))
        for tier, count in counts.items():  # a worker's own counters beat the estimate from timelines
            self._counters[tier].add(now, count)
            tiers[tier] = self._counters[tier].increase(now)
        unit = {tier: ("blocks" if tier in ("dram", "disk") else "tokens") for tier in tiers}
        refusals = dict(self.sources.refusals.refusals()) if self.sources.refusals is not None else {}
        experts = await self._read("expert loads", self.sources.experts, "expert_reports", notes) or {}
        return DashboardData(
            generated_at_unix_s=now, window_s=self.window_s, throughput=throughput,
            tenants=self._tenants(records, done, loads.values()), workers=[_worker(w) for w in sorted(
                loads.values(), key=lambda w: (w.kind, w.name))],
            tiers=[TierFigures(t, unit[t], c.hits, c.lookups, hit_rate(c)) for t, c in sorted(tiers.items())],
            refusals=refusals, recent=[_bar(r) for r in records[: self.num_recent]], notes=notes,
            experts=self._experts.figures(experts),
        )

    async def _read(self, what: str, source: object | None, method: str, notes: list[str]) -> Any:
        if source is None:
            return None
        try:
            return await asyncio.wait_for(getattr(source, method)(), SOURCE_TIMEOUT_S)
        except Exception as e:  # the page shows the rest and says what is missing
            logger.warning("dashboard: cannot read %s: %r", what, e)
            notes.append(f"{what} unavailable: {type(e).__name__}: {e}")
            return None

    def _tenants(self, records: list[RequestRecord], done: list[RequestRecord],
                 loads: Iterable[WorkerLoad] = ()) -> list[TenantFigures]:
        slos = self.sources.slos
        kv: dict[str, int] = {}
        for w in loads:
            for tenant, n in w.kv_blocks_by_tenant:
                kv[tenant] = kv.get(tenant, 0) + n
        names = {r.tenant for r in records if not r.finished} | {r.tenant for r in done} | {t for t in kv if t}
        names |= set(slos.known_tenants()) if slos is not None else set()
        out = []
        for name in sorted(names):
            mine = [r for r in done if r.tenant == name]
            ttft = [r.ttft_ms for r in mine if r.ttft_ms is not None]
            tpot = [r.tpot_ms for r in mine if r.tpot_ms is not None]
            slo = slos.slo(name) if slos is not None else None
            met = None if slo is None else attainment(((r.ttft_ms, r.tpot_ms) for r in mine), slo.ttft_ms, slo.tpot_ms)
            running = sum(1 for r in records if r.tenant == name and not r.finished)
            out.append(TenantFigures(
                tenant=name, num_completed=len(mine), num_running=running,
                num_output_tokens=sum(r.num_output_tokens for r in mine),
                ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
                tpot_p50_ms=percentile(tpot, 50), tpot_p99_ms=percentile(tpot, 99), slo=slo, slo_attainment=met,
                kv_blocks=kv.get(name, 0),
            ))
        return out


def _worker(w: WorkerLoad) -> WorkerFigures:
    return WorkerFigures(w.name, w.kind, w.healthy, w.num_running, w.num_waiting, w.num_reserved,
                         w.num_total_blocks - w.num_free_blocks, w.num_total_blocks, w.last_step_s * 1e3,
                         w.rss_mib, dict(w.kv_blocks_by_tenant), round(w.offloaded_bytes / 2**20, 1),
                         w.spec_method, w.spec_acceptance)


def _bar(r: RequestRecord) -> RequestBar:
    return RequestBar(r.request_id, r.tenant, r.finish_reason or "running", r.arrival_unix_s, r.ttft_ms, r.e2e_ms,
                      list(r.stages), list(r.token_ms))


def dashboard_for(backend: Any, *, slos: Mapping[str, Any] | SloSource | None = None,
                  refusals: RefusalSource | None = None, window_s: float = 60.0,
                  experts: Any = None) -> TimelineDashboard:
    """The provider for an HTTP backend: its timelines, plus its engine's stats (EngineBackend) or
    its `Router`'s worker loads (ClusterBackend), and the MoE expert loads of `experts` (anything
    with `expert_reports`: deploy/moe.py's RoutingView)."""
    engine = getattr(backend, "async_engine", None)
    client = getattr(backend, "client", None)
    loads: LoadSource | None = EngineSource(engine) if engine is not None else client
    prefix = loads if isinstance(loads, EngineSource) else None
    slo_source = StaticSlos(slos) if isinstance(slos, Mapping) else slos
    return TimelineDashboard(DashboardSources(BackendTimelines(backend), loads, prefix, slo_source, refusals, experts),
                             window_s=window_s)
