"""Scheduler configuration: one frozen dataclass per component, gathered in `SchedulerConfig`.

Mental model: deploy/ validates YAML/HTTP input with pydantic and converts it into these; inside
the cluster everything is immutable, and each component receives only its own section.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.admission import AdmissionConfig
from cluster.cost_model import StepCostPrior
from cluster.descriptors import TenantId
from cluster.placement import PlacementConfig
from cluster.scaling import ScalingConfig
from cluster.tenants import TenantConfig


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Everything `GlobalScheduler` needs.

    `default_tenant`: the contract given to tenant ids not listed in `tenants` (None refuses them
    with `unknown_tenant`). `heartbeat_timeout_s`: a worker silent this long is declared dead. `batch_deadline_s`: the
    deadline of requests an interactive tenant downgrades to batch.
    `reference_token_rate`: the fairness clock's initial cluster throughput (tokens/s); it is
    re-estimated from the fitted cost models as workers report. `slo_admission`/`fairness`
    switch those policies off (the simulator's ablations).
    """

    tenants: tuple[TenantConfig, ...] = ()
    default_tenant: TenantConfig | None = field(default_factory=lambda: TenantConfig(TenantId("default")))
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    cost_prior: StepCostPrior = field(default_factory=StepCostPrior)
    heartbeat_timeout_s: float = 2.0
    batch_deadline_s: float = 3600.0
    reference_token_rate: float = 1e5
    timeline_max_finished: int = 1000
    timeline_max_tokens: int = 512
    latency_window: int = 20000
    slo_admission: bool = True
    fairness: bool = True
    scaling: ScalingConfig | None = None  # replica-count advice per role (`cluster/scaling.py`); None: none

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout_s > 0:
            raise ValueError("heartbeat_timeout_s must be positive")
        if self.latency_window < 1:
            raise ValueError("latency_window must be >= 1")
