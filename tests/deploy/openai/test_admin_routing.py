"""/admin/routing: its own role (admin keys; a tenant key is 403, no key 401), reads and sets a
model's routing table through the controller (validation reasons as codes), rolls back; /health's
`moe` part; the MoE Prometheus metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from actors.engine.moe.budget import ExpertBudgets
from actors.engine.moe.routing_table import RoutingTable
from actors.engine.moe.telemetry import ExpertLoadReport
from cluster.moe.service import RoutingControlService
from deploy.moe import RoutingView
from deploy.moe_metrics import ExpertLoadExporter, moe_exported_names
from deploy.openai.admin import mount_admin
from deploy.openai.config import ApiConfig
from deploy.openai.errors import install_error_handlers
from tests.deploy.monitoring.fake_metrics import Recorded, install

ADMIN = {"Authorization": "Bearer ops-key-1"}
TENANT = {"Authorization": "Bearer sk-tenant"}


class LocalAdmin:
    """The admin contract over an in-process controller service (what RayRoutingAdmin is over the actor)."""

    def __init__(self, service: RoutingControlService) -> None:
        self.service = service

    async def state(self, model: str) -> dict[str, Any]:
        return self.service.state(model)

    async def set_table(self, model: str, bias: list[list[float]], version: int | None) -> dict[str, Any]:
        return self.service.set_table(model, bias, version)

    async def rollback(self, model: str) -> dict[str, Any]:
        return self.service.rollback(model)

    async def set_budgets(self, model: str, default: int | None, tenants: dict[str, int]) -> dict[str, Any]:
        return self.service.set_budgets(model, default, tenants)

    async def reports(self, model: str) -> dict[str, ExpertLoadReport]:
        return self.service.reports(model)


def report(version: int = 0, tokens=((30, 10, 10, 10), (20, 20, 10, 10))) -> ExpertLoadReport:  # type: ignore[no-untyped-def]
    return ExpertLoadReport(version, tuple(map(tuple, tokens)))


@pytest.fixture
def service() -> RoutingControlService:
    s = RoutingControlService(auto=False)
    for worker in ("decode-0", "prefill-0"):
        s.sync("tiny-moe", worker, report(), 2)
    return s


def client(service: RoutingControlService | None, **cfg: Any) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    api = ApiConfig(api_keys={"sk-tenant": "acme"}, admin_keys={"ops-key-1": "alice"}, **cfg)
    mount_admin(app, api, None if service is None else LocalAdmin(service), {"moe": "tiny-moe", "alias": "tiny-moe"})
    return TestClient(app)


def test_admin_role_is_its_own(service: RoutingControlService) -> None:
    c = client(service)
    assert c.get("/admin/routing/moe").status_code == 401
    assert c.get("/admin/routing/moe", headers={"Authorization": "Bearer wrong"}).status_code == 401
    refused = c.get("/admin/routing/moe", headers=TENANT)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    assert c.get("/admin/routing/moe", headers=ADMIN).status_code == 200
    with pytest.raises(ValueError, match="tenant key"):
        ApiConfig(api_keys={"k": "acme"}, admin_keys={"k": "alice"})
    closed = FastAPI()
    install_error_handlers(closed)
    mount_admin(closed, ApiConfig(auth_required=False), None, {"moe": "tiny-moe"})
    assert TestClient(closed).get("/admin/routing/moe", headers=ADMIN).status_code == 403


def test_read_set_and_roll_back_a_table(service: RoutingControlService) -> None:
    c = client(service)
    state = c.get("/admin/routing/alias", headers=ADMIN).json()
    assert state["table"]["version"] == 0 and state["workers"] == {"decode-0": 0, "prefill-0": 0}
    bias = [[-1.0, 0.0, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    put = c.put("/admin/routing/moe", headers=ADMIN, json={"bias": bias})
    assert put.status_code == 200 and put.json()["table"] == {"version": 1, "bias": bias}
    assert not put.json()["consistent"]  # the workers take it on their next sync
    for worker in ("decode-0", "prefill-0"):
        assert service.sync("tiny-moe", worker, report(0), 2).table == RoutingTable.of(1, bias)
        service.sync("tiny-moe", worker, report(1), 2)
    assert c.get("/admin/routing/moe", headers=ADMIN).json()["consistent"]
    for body, code in (({"bias": [[0.0] * 4]}, "shape"), ({"bias": [[99.0] + [0.0] * 3, [0.0] * 4]}, "out_of_bounds"),
                       ({"bias": bias, "version": 1}, "stale_version")):
        bad = c.put("/admin/routing/moe", headers=ADMIN, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == code, body
    assert c.put("/admin/routing/moe", headers=ADMIN, json={"bias": bias, "extra": 1}).status_code == 400
    back = c.post("/admin/routing/moe/rollback", headers=ADMIN).json()
    assert back["table"]["version"] == 2 and back["table"]["bias"] == [[0.0] * 4] * 2
    assert [d["action"] for d in back["decisions"]] == ["set_by_admin", "rolled_back"]


def test_tenant_expert_budgets_reach_the_workers(service: RoutingControlService) -> None:
    c = client(service)
    put = c.put("/admin/routing/moe/budgets", headers=ADMIN, json={"default": None, "tenants": {"acme": 2}})
    assert put.status_code == 200 and put.json()["budgets"] == {"default": None, "tenants": {"acme": 2}}
    update = service.sync("tiny-moe", "decode-0", report(), 2)
    assert update.budgets == ExpertBudgets(None, (("acme", 2),)) and update.budgets.of_tenant("acme") == 2
    for bad in ({"tenants": {"acme": 0}}, {"default": 0}, {"tenants": {"acme": "x"}}, {"nope": 1}):
        r = c.put("/admin/routing/moe/budgets", headers=ADMIN, json=bad)
        assert r.status_code == 400, bad
    assert c.put("/admin/routing/moe/budgets", headers=TENANT, json={}).status_code == 403


def test_unknown_and_dense_models(service: RoutingControlService) -> None:
    assert client(service).get("/admin/routing/nope", headers=ADMIN).json()["error"]["code"] == "model_not_found"
    dense = client(None).get("/admin/routing/moe", headers=ADMIN)
    assert dense.status_code == 404 and dense.json()["error"]["code"] == "no_routing_table"
    fresh = client(RoutingControlService(auto=False)).get("/admin/routing/moe", headers=ADMIN)
    assert fresh.status_code == 404 and fresh.json()["error"]["code"] == "model_not_reported"


def test_health_gains_each_workers_expert_load_summary(service: RoutingControlService) -> None:
    moe = asyncio.run(RoutingView(LocalAdmin(service), "tiny-moe").health())  # type: ignore[arg-type]
    assert moe["table_version"] == 0 and moe["consistent"]
    decode = moe["workers"]["decode-0"]
    assert decode["imbalance_by_layer"] == [2.0, 1.333] and decode["imbalance_max"] == 2.0
    assert decode["hottest"][0] == {"layer": 0, "expert": 0, "share": 0.5} and decode["tokens_routed"] == 120
    gone = asyncio.run(RoutingView(LocalAdmin(RoutingControlService(auto=False)), "x").health())  # type: ignore[arg-type]
    assert gone["workers"] == {}


def test_metrics_count_tokens_and_gauge_the_latest_period(monkeypatch: pytest.MonkeyPatch) -> None:
    rec: Recorded = install(monkeypatch)
    exporter = ExpertLoadExporter()
    exporter.export({"w": report(3)})
    assert rec.total("ferry_moe_expert_tokens", worker="w", layer="0", expert="0") == 30
    assert rec.gauge("ferry_moe_imbalance", worker="w", layer="0") == 2.0
    assert rec.gauge("ferry_moe_table_version", worker="w") == 3.0
    recent = exporter.export({"w": report(4, ((30, 50, 10, 10), (20, 20, 10, 10)))})
    assert recent["w"] == [[0, 40, 0, 0], [0, 0, 0, 0]]
    assert rec.total("ferry_moe_expert_tokens", worker="w", layer="0", expert="1") == 50
    assert rec.gauge("ferry_moe_imbalance", worker="w", layer="0") == 4.0  # only the last period's tokens
    assert rec.gauge("ferry_moe_expert_share", worker="w", layer="0", expert="1") == 1.0
    assert "ray_ferry_moe_expert_tokens_total" in moe_exported_names()
