"""`Monitoring`: what the ingress adds for operators (metrics, the dashboard), wired in three lines.

Mental model: the ingress builds one `Monitoring` around its HTTP backend.
- `monitoring.backend` is what to hand `build_api`: a `MeteredBackend` (below), which records each
  request from its timeline when its stream ends, and each refusal, into `RequestMetrics` (whose
  refusal counts the dashboard shows too), and adds the dashboard's per-tenant SLO attainment to
  `/health`.
- `monitoring.mount(app)` adds the dashboard routes and hooks a task into the app's lifespan that
  every `period_s` reads a `ClusterSnapshot` (the backend's worker loads, or its engine's stats)
  and hands it to the `ClusterMetricsExporter`. Serve runs the ASGI lifespan of an ingress app, so
  the task lives exactly as long as the replica serves; uvicorn runs it with `lifespan="on"`.
  With a semantic cache (`semantic`: anything with `async stats()`), its stats join each snapshot.
A failed snapshot is logged and skipped; the next period tries again. A semantic cache that does
not answer only leaves its part out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import aclosing, asynccontextmanager
from typing import Any, Protocol

from fastapi import FastAPI

from actors.engine.output import RequestOutput
from actors.engine.sampling import SamplingParams
from actors.engine.tokenizer import Tokenizer
from actors.prefix_cache.stats import PrefixCacheStats, TenantUse
from actors.semantic_cache.stats import SemanticCacheStats
from deploy.dashboard.provider import EngineSource, SloSource, TimelineDashboard, dashboard_for, load_of_engine
from deploy.dashboard.routes import mount_dashboard
from deploy.metrics import ClusterMetricsExporter, ClusterSnapshot, RequestMetrics, refusal_reason
from deploy.openai.backend import Refused

logger = logging.getLogger(__name__)


class MeteredBackend:
    """An HTTP `Backend` that feeds `RequestMetrics`: each request that produced output is recorded
    from the inner backend's timeline once its stream ends (finished, aborted or failed), each
    refusal by reason. Everything else is the inner backend's (`timeline`, `timelines`, `client`)."""

    def __init__(self, inner: Any, metrics: RequestMetrics) -> None:
        self.inner = inner
        self.metrics = metrics
        # Set by `Monitoring` once its dashboard, which reads this backend's timelines, exists.
        self.slo_report: Callable[[], dict[str, Any]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self.inner.tokenizer

    async def health(self) -> dict[str, Any]:
        """The inner backend's report plus `slo`, each tenant's SLO attainment over the dashboard's
        window (`TimelineDashboard.slo_report`), which `ferry status` prints."""
        report = await self.inner.health()
        if self.slo_report is not None:
            try:
                report = report | {"slo": self.slo_report()}
            except Exception:  # a figures bug must not make a healthy backend look down
                logger.exception("cannot compute the SLO report for /health")
        return report

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       tenant: str) -> AsyncGenerator[RequestOutput, None]:
        started = False
        try:
            # aclosing: closing this stream must close the inner one at once, which aborts the request.
            async with aclosing(self.inner.generate(request_id, prompt_token_ids, params, tenant=tenant)) as stream:
                async for out in stream:
                    started = True
                    yield out
        except Refused as e:
            self.metrics.on_refused(tenant, refusal_reason(e))
            raise
        finally:
            if started:
                self._record(request_id)

    def _record(self, request_id: str) -> None:
        timeline = getattr(self.inner, "timeline", None)
        found = timeline(request_id) if timeline is not None else None
        try:
            if found is not None:
                self.metrics.on_finished(found)
        except Exception:  # a metrics bug must never fail a request
            logger.exception("cannot record metrics of %s", request_id)


class SemanticStatsSource(Protocol):
    async def stats(self) -> SemanticCacheStats: ...


class PoolStatsSource(Protocol):
    async def stats(self) -> PrefixCacheStats: ...

    async def tenant_usage(self) -> dict[str, TenantUse]: ...


class Monitoring:
    def __init__(self, backend: Any, *, slos: Mapping[str, Any] | SloSource | None = None, period_s: float = 5.0,
                 window_s: float = 60.0, access_key: str | None = None,
                 semantic: SemanticStatsSource | None = None, pool: PoolStatsSource | None = None) -> None:
        assert period_s > 0
        self.request_metrics = RequestMetrics()
        self.exporter = ClusterMetricsExporter()
        self.backend = MeteredBackend(backend, self.request_metrics)
        self.provider: TimelineDashboard = dashboard_for(self.backend, slos=slos, refusals=self.request_metrics,
                                                         window_s=window_s)
        self.backend.slo_report = self.provider.slo_report
        self.period_s = period_s
        self.access_key = access_key
        self.semantic = semantic
        self.pool = pool

    def mount(self, app: FastAPI) -> None:
        mount_dashboard(app, self.provider, access_key=self.access_key)
        run_in_lifespan(app, self.export_once, self.period_s)

    async def snapshot(self) -> ClusterSnapshot:
        """What the ingress can read today: one engine's stats, or the `Router`'s worker loads,
        and the semantic cache's stats. Engine, pool and transport stats of remote workers join
        once the workers report them."""
        source = self.provider.sources.loads
        semantic = await self._stats_of("semantic cache", self.semantic)
        pool = await self._stats_of("prefix-cache pool", self.pool)
        tenants = await self._stats_of("prefix-cache pool tenants", self.pool, "tenant_usage") or {}
        parts = {"semantic": semantic, "pool": pool, "pool_tenants": tenants}
        if isinstance(source, EngineSource):
            stats = await source.stats()
            load = load_of_engine(source.name, stats, healthy=source.async_engine.is_alive)
            return ClusterSnapshot(loads=(load,), engines={source.name: stats}, **parts)
        if source is not None:
            return ClusterSnapshot(loads=tuple((await source.loads()).values()), **parts)
        return ClusterSnapshot(**parts)

    async def _stats_of(self, what: str, source: SemanticStatsSource | PoolStatsSource | None,
                        method: str = "stats") -> Any:
        if source is None:
            return None
        try:
            return await getattr(source, method)()
        except Exception as e:  # the rest of the snapshot still counts
            logger.warning("%s stats unavailable: %r", what, e)
            return None

    async def export_once(self) -> None:
        self.exporter.export(await self.snapshot())


def run_in_lifespan(app: FastAPI, work: Callable[[], Awaitable[None]], period_s: float) -> None:
    """Runs `work()` every `period_s` while the app is up (between lifespan startup and shutdown),
    each run bounded by the period so a hung worker cannot stall the loop."""
    inner = app.router.lifespan_context

    async def repeat() -> None:
        while True:
            try:
                await asyncio.wait_for(work(), period_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the next period tries again
                logger.warning("periodic %s failed: %r", getattr(work, "__name__", "work"), e)
            await asyncio.sleep(period_s)

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        task = asyncio.create_task(repeat())
        try:
            async with inner(a) as state:
                yield state
        finally:
            task.cancel()

    app.router.lifespan_context = lifespan
