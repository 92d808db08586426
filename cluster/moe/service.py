"""`RoutingControlService`: the routing controller as a service, ticking on its own, behind one lock.

Mental model: workers call `sync` every second or so; operators call `state`, `set_table`,
`rollback`, `set_budgets` (the admin endpoint); a background thread calls `tick` for every known
model each `tick_s`. A lock serialises them, since Ray may run an actor's calls on one thread while
the ticker runs on another. `reports` hands each worker's latest `ExpertLoadReport` to the ingress,
for /health, Prometheus and the dashboard. Wrapped as a Ray actor in cluster/moe/actor.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from actors.engine.moe.budget import ExpertBudgets
from actors.engine.moe.routing_table import RoutingTable, RoutingUpdate
from actors.engine.moe.telemetry import ExpertLoadReport
from cluster.moe.controller import ControllerConfig, Decision, RoutingController

logger = logging.getLogger(__name__)


class RoutingControlService:
    def __init__(self, cfg: ControllerConfig | None = None, tick_s: float = 5.0, auto: bool = True) -> None:
        """`auto`: tick on a timer; off, the tables change only through the admin endpoint."""
        self.controller = RoutingController(cfg)
        self.tick_s = tick_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if auto:
            self._thread = threading.Thread(target=self._loop, name="moe-routing-ticks", daemon=True)
            self._thread.start()

    def ping(self) -> bool:
        return True

    def sync(self, model: str, worker: str, report: ExpertLoadReport, top_k: int,
             sample: Sequence[torch.Tensor] | None = None, active: RoutingTable | None = None) -> RoutingUpdate:
        with self._lock:
            return self.controller.sync(model, worker, report, top_k, sample, active)

    def tick(self) -> list[Decision]:
        with self._lock:
            return [d for model in list(self.controller.models) if (d := self.controller.tick(model)) is not None]

    def _loop(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a bad tick must not stop the next ones
                logger.exception("routing controller tick failed")

    def state(self, model: str) -> dict[str, object]:
        with self._lock:
            return self.controller.state(model)

    def set_table(self, model: str, bias: list[list[float]], version: int | None = None) -> dict[str, object]:
        with self._lock:
            self.controller.set_table(model, bias, version)
            return self.controller.state(model)

    def set_budgets(self, model: str, default: int | None, tenants: dict[str, int]) -> dict[str, object]:
        with self._lock:
            self.controller.set_budgets(model, ExpertBudgets.of(default, tenants))
            return self.controller.state(model)

    def rollback(self, model: str) -> dict[str, object]:
        with self._lock:
            self.controller.rollback(model)
            return self.controller.state(model)

    def reports(self, model: str) -> dict[str, ExpertLoadReport]:
        with self._lock:
            m = self.controller.models.get(model)
            return dict(m.reports) if m is not None else {}

    def models(self) -> list[str]:
        with self._lock:
            return sorted(self.controller.models)

    def close(self) -> None:
        self._stop.set()
