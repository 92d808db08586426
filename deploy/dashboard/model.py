"""What the dashboard page shows, as plain dataclasses, and the `DashboardProvider` that makes them.

Mental model: the page is a pure view of one `DashboardData` (served as JSON at
`/dashboard/data`). Whoever knows the figures implements `DashboardProvider`: today
`TimelineDashboard` (provider.py) computes them inside the ingress from recent request timelines
and worker loads; later the cluster scheduler, which sees every request and owns the SLOs, can
answer with its own figures (SLO attainment, refusals) through the same protocol without the page
changing. Every latency is in milliseconds, every rate per second, every time wall-clock seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from deploy.dashboard.experts import ExpertFigures
from deploy.dashboard.records import StageSpan


@dataclass(frozen=True)
class SloTargets:
    """A tenant's P99 promises (same fields as cluster/tenants.py's `InteractiveSlo`)."""

    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class TenantFigures:
    tenant: str
    num_completed: int  # requests the model finished inside the window
    num_running: int  # requests of this tenant still streaming
    num_output_tokens: int  # of the completed requests
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    slo: SloTargets | None  # None: "no SLO" (batch tenants, or none configured)
    slo_attainment: float | None  # fraction meeting both targets; None without an SLO or requests
    kv_blocks: int = 0  # engine KV blocks charged to it now, over every worker (in use + its cached prefixes)


@dataclass(frozen=True)
class Throughput:
    span_s: float  # what the rates are averaged over (the window, or less right after a start)
    num_completed: int
    num_output_tokens: int  # tokens streamed inside the span, running requests included
    requests_per_s: float
    output_tokens_per_s: float


@dataclass(frozen=True)
class WorkerFigures:
    name: str
    kind: str  # prefill | decode | colocated
    healthy: bool
    num_running: int
    num_waiting: int
    num_reserved: int
    kv_blocks_used: int
    kv_blocks_total: int
    last_step_ms: float
    rss_mib: int | None = None  # the worker process's resident memory
    kv_blocks_by_tenant: dict[str, int] = field(default_factory=dict)  # the engine's blocks charged to each
    offloaded_mib: float = 0.0  # host memory holding preempted batch requests' KV
    spec_method: str = "off"  # speculative decoding's proposer (decode and colocated workers)
    spec_acceptance: float | None = None  # accepted over proposed draft tokens since it started; None: none yet


@dataclass(frozen=True)
class TierFigures:
    """A prefix-cache tier over the window: hbm (the engines' own block pool), pool (the prefix-cache
    pool as seen by prefills), dram and disk (the pool's own tiers)."""

    tier: str
    unit: str  # "tokens" or "blocks"
    hits: int
    lookups: int
    hit_rate: float | None


@dataclass(frozen=True)
class RequestBar:
    """One row of the timeline chart."""

    request_id: str
    tenant: str
    status: str  # running | a finish reason
    arrival_unix_s: float
    ttft_ms: float | None
    e2e_ms: float | None
    stages: list[StageSpan]
    token_ms: list[float]


@dataclass(frozen=True)
class DashboardData:
    generated_at_unix_s: float
    window_s: float
    throughput: Throughput
    tenants: list[TenantFigures]
    workers: list[WorkerFigures]
    tiers: list[TierFigures]
    refusals: dict[str, int]  # by reason, since the ingress started
    recent: list[RequestBar]  # newest first
    notes: list[str] = field(default_factory=list)  # what could not be read this time, and why
    experts: list[ExpertFigures] = field(default_factory=list)  # MoE models: per worker (deploy/dashboard/experts.py)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class DashboardProvider(Protocol):
    """Contract: `dashboard_data()` returns the figures as of now. The page calls it every ~2 s
    on the app's event loop, so it must not block the loop (blocking reads go to a thread) and
    should answer within a second. A source that fails is reported in `notes` and its section
    left empty; the call raises only on a bug."""

    async def dashboard_data(self) -> DashboardData: ...
