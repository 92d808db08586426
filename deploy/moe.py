"""The ingress's side of MoE routing control: the controller actor, the admin calls, /health, metrics.

Mental model: for a mixture-of-experts model the ingress starts the routing controller actor
(cluster/moe/actor.py) before its workers, which link to it by name (actors/moe_link.py).
`RayRoutingAdmin` is the admin endpoint's `RoutingAdmin` over that actor, every call bounded by a
deadline. `RoutingView` is what the ingress shows of it: the `moe` part of `/health` (the published
table version, whether every worker routes with it, and per worker its summary (version, tokens,
imbalance by layer, hottest expert, safe-mode layers), and the dashboard's expert loads. `export_expert_loads` feeds Prometheus
(deploy/moe_metrics.py) each monitoring period. A controller that does not answer leaves an
`error` in /health, never an unhealthy app.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.exceptions import RayTaskError

from actors.engine.moe.routing_table import TableRejected
from actors.engine.moe.telemetry import ExpertLoadReport
from deploy.moe_metrics import ExpertLoadExporter

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 5.0


class RayRoutingAdmin:
    def __init__(self, actor: Any, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.actor, self.timeout_s = actor, timeout_s

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await asyncio.wait_for(getattr(self.actor, method).remote(*args), self.timeout_s)
        except RayTaskError as e:  # the controller's own answer (a refused table, an unknown model)
            if isinstance(e.cause, (TableRejected, KeyError)):
                raise e.cause from None
            raise

    async def state(self, model: str) -> dict[str, Any]:
        return await self._call("state", model)

    async def set_table(self, model: str, bias: list[list[float]], version: int | None) -> dict[str, Any]:
        return await self._call("set_table", model, bias, version)

    async def rollback(self, model: str) -> dict[str, Any]:
        return await self._call("rollback", model)

    async def set_budgets(self, model: str, default: int | None, tenants: dict[str, int]) -> dict[str, Any]:
        return await self._call("set_budgets", model, default, tenants)

    async def reports(self, model: str) -> dict[str, ExpertLoadReport]:
        return await self._call("reports", model)


def moe_health(state: dict[str, Any], reports: dict[str, ExpertLoadReport]) -> dict[str, Any]:
    return {"table_version": state["table"]["version"], "consistent": state["consistent"],
            "workers": {name: r.summary() for name, r in sorted(reports.items())}}


class RoutingView:
    """The routing controller's state of one model, as `/health` and the dashboard show it."""

    def __init__(self, admin: RayRoutingAdmin, model: str) -> None:
        self.admin, self.model = admin, model

    async def expert_reports(self) -> dict[str, ExpertLoadReport]:
        """Each worker's latest expert loads (the dashboard's `ExpertSource`)."""
        return await self.admin.reports(self.model)

    async def health(self) -> dict[str, Any]:
        """The `moe` part of /health (the app's hook: deploy/openai/hooks.py)."""
        try:
            state, reports = await asyncio.gather(self.admin.state(self.model), self.admin.reports(self.model))
            return moe_health(state, reports)
        except KeyError:
            return {"workers": {}, "note": "no worker has reported yet"}
        except Exception as e:  # detail only: serving does not depend on the controller
            return {"error": f"{type(e).__name__}: {e}"}


def expert_load_exporter(admin: RayRoutingAdmin, model: str):  # type: ignore[no-untyped-def]
    """The periodic task: read every worker's report from the controller, record it."""
    exporter = ExpertLoadExporter()

    async def export_expert_loads() -> None:
        exporter.export(await admin.reports(model))

    return export_expert_loads
