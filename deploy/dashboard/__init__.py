"""The live dashboard served by the ingress at `/dashboard` (a self-contained page plus its JSON).

    from deploy.dashboard.monitoring import Monitoring   # not re-exported: it imports deploy.metrics,
    from deploy.dashboard import SloTargets              # which imports this package's records
    monitoring = Monitoring(backend, slos={"acme": SloTargets(ttft_ms=500, tpot_ms=50)})
    app = build_api(backend, cfg)
    monitoring.mount(app)   # requests and refusals reach the metrics; /dashboard, periodic cluster metrics

`DashboardProvider` is the seam: `TimelineDashboard` computes the figures in the ingress from
recent request timelines and worker loads; the cluster scheduler can supply its own later.
"""

from deploy.dashboard.model import DashboardData, DashboardProvider, SloTargets
from deploy.dashboard.provider import (BackendTimelines, DashboardSources, EngineSource, StaticSlos,
                                       TimelineDashboard, dashboard_for)
from deploy.dashboard.routes import mount_dashboard

__all__ = ["BackendTimelines", "DashboardData", "DashboardProvider", "DashboardSources", "EngineSource",
           "SloTargets", "StaticSlos", "TimelineDashboard", "dashboard_for", "mount_dashboard"]
