"""One request's `RequestPolicy`, resolved once at the Gate from its tenant and its headers.

Mental model: what a request may and must get is decided in one place, before any handler runs:
its tenant (from the API key), the tenant's configured say (`scheduler.tenants.<name>`:
speculation on or off, KV recovery by shadowing or recomputing; `TenantRules`), and the caller's
say for this one request through three headers, each of which can only narrow what the tenant
allows:
- `x-ferry-slo-class: batch` runs it as batch work (it fills idle capacity and has a completion
  deadline instead of TTFT/TPOT targets); a tenant may downgrade its requests, never upgrade them,
  so any other value is ignored;
- `x-ferry-speculation: off | auto` (speculation.py): off keeps the engines from drafting for it;
  an unknown value is a 400; off from either the caller or the tenant wins;
- `x-ferry-expert-budget: N` (expert_budget.py, MoE models): a whole number >= 1, else a 400.
The result is frozen and travels explicitly: the Gate stores it as the request's scope state
`policy`, the endpoint hands it to `Backend.generate(..., policy=)`, and the cluster backend writes
it into the `GenerationRequest` (`RequestPolicy.request`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from starlette.datastructures import Headers

from actors.messages import RequestPolicy
from deploy.openai import expert_budget, speculation
from deploy.openai.errors import ApiError

SLO_CLASS_HEADER = "x-ferry-slo-class"


@dataclass(frozen=True)
class TenantRules:
    """A tenant's configured say on each of its requests."""

    speculation: bool = True
    kv_recovery: Literal["shadow", "recompute"] = "recompute"


@dataclass(frozen=True)
class PolicyBook:
    """Every tenant's rules (`default` for tenants not listed) and how a request's policy follows."""

    tenants: Mapping[str, TenantRules] = field(default_factory=dict)
    default: TenantRules = TenantRules()

    def rules(self, tenant: str) -> TenantRules:
        return self.tenants.get(tenant, self.default)

    def resolve(self, tenant: str, headers: Headers) -> RequestPolicy:
        """The policy of one API request of `tenant`; an invalid header is an `ApiError` 400 naming it."""
        rules = self.rules(tenant)
        return RequestPolicy(tenant=tenant, slo_class="batch" if _last(headers, SLO_CLASS_HEADER) == "batch" else None,
                             speculation=rules.speculation and _speculation(headers),
                             expert_budget=_expert_budget(headers), kv_recovery=rules.kv_recovery)


def _last(headers: Headers, name: str) -> str | None:
    values = headers.getlist(name)
    return values[-1].strip().lower() if values else None


def _speculation(headers: Headers) -> bool:
    values = headers.getlist(speculation.HEADER)
    allowed = speculation.parse_speculation(values[-1] if values else None)
    if allowed is None:
        raise ApiError(400, f"Invalid {speculation.HEADER} header {values[-1]!r}: use 'off' (no speculative "
                            "decoding for this request) or 'auto' (the engine decides).",
                       param=speculation.HEADER, code="invalid_header")
    return allowed


def _expert_budget(headers: Headers) -> int | None:
    values = headers.getlist(expert_budget.HEADER)
    try:
        return expert_budget.parse_expert_budget(values[-1] if values else None)
    except ValueError as e:
        raise ApiError(400, str(e), param=expert_budget.HEADER, code="invalid_header") from None
