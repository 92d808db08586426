"""`Monitoring`: what the ingress adds for operators (metrics, the dashboard), wired in three lines.

Mental model: the ingress builds one `Monitoring` beside its HTTP backend, and mounts it on the app
`build_api` made from that backend.
- `monitoring.mount(app)` adds `RequestMetrics` to the app's request observers
  (deploy/openai/hooks.py: each request is recorded from its timeline when its stream ends, each
  refusal by reason; the dashboard shows the refusal counts too), the dashboard's per-tenant SLO
  attainment as the `slo` part of `/health`, the dashboard routes, and a task in the app's lifespan that
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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Protocol

from fastapi import FastAPI

from actors.prefix_cache.stats import PrefixCacheStats, TenantUse
from actors.semantic_cache.stats import SemanticCacheStats
from deploy.dashboard.provider import EngineSource, SloSource, TimelineDashboard, dashboard_for, load_of_engine
from deploy.dashboard.routes import mount_dashboard
from deploy.metrics import ClusterMetricsExporter, ClusterSnapshot, RequestMetrics
from deploy.openai.hooks import AppHooks

logger = logging.getLogger(__name__)


class SemanticStatsSource(Protocol):
    async def stats(self) -> SemanticCacheStats: ...


class PoolStatsSource(Protocol):
    async def stats(self) -> PrefixCacheStats: ...

    async def tenant_usage(self) -> dict[str, TenantUse]: ...


class Monitoring:
    def __init__(self, backend: Any, *, slos: Mapping[str, Any] | SloSource | None = None, period_s: float = 5.0,
                 window_s: float = 60.0, access_key: str | None = None,
                 semantic: SemanticStatsSource | None = None, pool: PoolStatsSource | None = None,
                 experts: Any = None) -> None:
        """`experts`: an `ExpertSource` (deploy/moe.py's `RoutingView`) for MoE models."""
        assert period_s > 0
        self.request_metrics = RequestMetrics()
        self.exporter = ClusterMetricsExporter()
        self.provider: TimelineDashboard = dashboard_for(backend, slos=slos, refusals=self.request_metrics,
                                                         window_s=window_s, experts=experts)
        self.period_s = period_s
        self.access_key = access_key
        self.semantic = semantic
        self.pool = pool

    def mount(self, app: FastAPI) -> None:
        hooks: AppHooks = app.state.hooks
        hooks.observers.append(self.request_metrics)
        hooks.health_parts["slo"] = self.provider.slo_report  # each tenant's attainment: `ferry status` prints it
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
