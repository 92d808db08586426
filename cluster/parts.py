"""SchedulerParts: the collaborators `GlobalScheduler` builds once and shares with the classes it sequences.

Mental model: the scheduler owns its state through a handful of objects (journal, ledger, worker
views, cost models, prefix index, tenants, fairness clock, placement policy, timelines, latency
window, counters) read through one clock. `RecoveryPlanner` and `Snapshots` work on the same
objects, so they take this one frozen bundle of references instead of a dozen arguments each.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.bookings import Ledger
from cluster.clock import Clock
from cluster.cost_model import CostModelBank
from cluster.fairness import FairShareClock
from cluster.journal import Journal
from cluster.placement import PlacementConfig, PlacementPolicy
from cluster.prefix_index import PrefixIndex
from cluster.stats import LatencyWindow, SchedulerStats
from cluster.tenants import TenantRegistry
from cluster.timeline import TimelineStore
from cluster.workers import WorkerRegistry


@dataclass(frozen=True)
class SchedulerParts:
    cfg: PlacementConfig
    clock: Clock
    journal: Journal
    ledger: Ledger
    workers: WorkerRegistry
    models: CostModelBank
    index: PrefixIndex
    tenants: TenantRegistry
    fairness: FairShareClock
    policy: PlacementPolicy
    timelines: TimelineStore
    latency: LatencyWindow
    counters: SchedulerStats
