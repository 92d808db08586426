"""`mount_admin(app, cfg, routing)`: operator endpoints under /admin/, with a role of their own.

Mental model: /admin/* is for operators, not tenants. A call needs `Authorization: Bearer <key>` with
one of `ApiConfig.admin_keys` (compared in constant time); no key or an unknown one is 401, a
tenant's API key is 403 (a known caller without the role), whatever `auth_required` says: an open
demo API still keeps its controls closed. With no admin key configured, every /admin/ call is 403.
The routing endpoints read and set the per-expert routing bias table of a model (served names):

- `GET /admin/routing/{model}`: the published table, the version each worker routes with, whether
  they all agree, and the controller's recent decisions.
- `PUT /admin/routing/{model}` with `{"bias": [[...], ...], "version": n?}`: validates (shape,
  finite, bounds, newer version: 400 with the reason as `code`) and publishes; every worker takes
  it on its next sync and swaps it in between two steps.
- `POST /admin/routing/{model}/rollback`: back to the previous table (as a newer version).
- `PUT /admin/routing/{model}/budgets` with `{"default": n?, "tenants": {"acme": 2}}`: request-level
  expert budgets (experts per layer a request's decode tokens may use, chosen from its prompt), by
  tenant; every worker takes them on its next sync.
"""

from __future__ import annotations

import hmac
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from actors.engine.moe.routing_table import TableRejected
from deploy.openai.config import ApiConfig
from deploy.openai.errors import ApiError


class RoutingAdmin(Protocol):
    """The routing controller as the ingress reaches it. Raises `TableRejected` for a bad table,
    KeyError for a model no worker reported yet, anything else when the controller is unreachable."""

    async def state(self, model: str) -> dict[str, Any]: ...

    async def set_table(self, model: str, bias: list[list[float]], version: int | None) -> dict[str, Any]: ...

    async def rollback(self, model: str) -> dict[str, Any]: ...

    async def set_budgets(self, model: str, default: int | None, tenants: dict[str, int]) -> dict[str, Any]: ...


class RoutingTableUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bias: list[list[float]] = Field(description="Per MoE layer, a bias per expert (logit units).")
    version: int | None = Field(None, description="Newer than the published one; default: the next.")


class ExpertBudgetUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default: int | None = Field(None, ge=1, description="Experts per layer for tenants not listed; null: all.")
    tenants: dict[str, Annotated[int, Field(ge=1)]] = Field(
        default_factory=dict, description="Tenant -> experts per layer its requests' decode tokens may use.")


def admin_guard(cfg: ApiConfig):  # type: ignore[no-untyped-def]
    keys = [(k.encode(), who) for k, who in cfg.admin_keys.items()]
    tenant_keys = [k.encode() for k in cfg.api_keys]

    def guard(request: Request) -> str:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        given = key.strip().encode() if scheme.lower() == "bearer" else b""
        found = [who for k, who in keys if hmac.compare_digest(k, given)]
        if found and given:
            return found[0]
        if given and any(hmac.compare_digest(k, given) for k in tenant_keys):
            raise ApiError(403, "This key has no operator role; /admin/ needs an admin key.", type="permission_error",
                           code="permission_denied")
        if not keys:
            raise ApiError(403, "No admin keys are configured (api.admin_keys): /admin/ is closed.",
                           type="permission_error", code="permission_denied")
        raise ApiError(401, "An admin key is required: send it as 'Authorization: Bearer <key>'.",
                       type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return guard


def mount_admin(app: FastAPI, cfg: ApiConfig, routing: RoutingAdmin | None, served: dict[str, str]) -> None:
    """`served`: each name clients use for a model -> the name its routing tables go by."""
    operator = Depends(admin_guard(cfg))

    def checked(model: str) -> RoutingAdmin:
        if model not in served:
            raise ApiError(404, f"The model '{model}' is not served here.", param="model", code="model_not_found")
        if routing is None:
            raise ApiError(404, f"The model '{model}' has no routing table (not a mixture-of-experts model).",
                           param="model", code="no_routing_table")
        return routing

    async def call(what: str, model: str, coro: Any) -> dict[str, Any]:
        try:
            return await coro
        except TableRejected as e:
            raise ApiError(400, f"Routing table refused: {e}", param="bias", code=e.reason) from None
        except KeyError:
            raise ApiError(404, f"No worker of '{model}' has reported to the routing controller yet.",
                           param="model", code="model_not_reported") from None
        except ApiError:
            raise
        except Exception as e:  # the controller restarting or gone: a retryable condition
            raise ApiError(503, f"The routing controller did not answer ({what}): {type(e).__name__}.",
                           type="server_error", code="routing_unavailable", headers={"Retry-After": "5"}) from None

    @app.get("/admin/routing/{model}", tags=["admin"])
    async def routing_state(model: str, who: str = operator) -> dict[str, Any]:
        return await call("state", model, checked(model).state(served[model]))

    @app.put("/admin/routing/{model}", tags=["admin"])
    async def routing_set(model: str, body: RoutingTableUpdate, who: str = operator) -> dict[str, Any]:
        return await call("set_table", model, checked(model).set_table(served[model], body.bias, body.version))

    @app.put("/admin/routing/{model}/budgets", tags=["admin"])
    async def routing_budgets(model: str, body: ExpertBudgetUpdate, who: str = operator) -> dict[str, Any]:
        return await call("set_budgets", model, checked(model).set_budgets(served[model], body.default, body.tenants))

    @app.post("/admin/routing/{model}/rollback", tags=["admin"])
    async def routing_rollback(model: str, who: str = operator) -> dict[str, Any]:
        return await call("rollback", model, checked(model).rollback(served[model]))
