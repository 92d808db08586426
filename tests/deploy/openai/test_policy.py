"""A request's `RequestPolicy`: resolved once by the Gate from its tenant's rules and its headers,
carried into the `GenerationRequest`, and read from there by the scheduler link (the SLO class)."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from actors.engine.sampling import SamplingParams
from actors.messages import RequestPolicy
from cluster.descriptors import SloClass
from cluster.router.adapters import request_desc
from deploy.openai.errors import ApiError
from deploy.openai.policy import PolicyBook, TenantRules

BOOK = PolicyBook({"quiet": TenantRules(speculation=False), "safe": TenantRules(kv_recovery="shadow")})


def resolve(tenant: str = "acme", **headers: str) -> RequestPolicy:
    return BOOK.resolve(tenant, Headers({k.replace("_", "-"): v for k, v in headers.items()}))


def test_the_slo_class_header_only_downgrades_to_batch() -> None:
    assert resolve(x_ferry_slo_class="Batch ").slo_class == "batch"
    assert resolve(x_ferry_slo_class="interactive").slo_class is None  # never an upgrade
    assert resolve().slo_class is None
    req = resolve(x_ferry_slo_class="batch").request("r", [1, 2, 3], SamplingParams())
    assert req.slo_class == "batch" and request_desc(req).slo_class is SloClass.BATCH
    assert request_desc(resolve().request("s", [1, 2], SamplingParams())).slo_class is None  # the tenant's


def test_speculation_off_from_the_caller_or_the_tenant_wins() -> None:
    assert resolve().speculation and not resolve(x_ferry_speculation="off").speculation
    assert not resolve("quiet").speculation and not resolve("quiet", x_ferry_speculation="auto").speculation
    with pytest.raises(ApiError) as e:
        resolve(x_ferry_speculation="sometimes")
    assert e.value.status == 400 and e.value.param == "x-ferry-speculation"


def test_the_expert_budget_header_is_a_whole_number() -> None:
    assert resolve(x_ferry_expert_budget="2").expert_budget == 2 and resolve().expert_budget is None
    with pytest.raises(ApiError) as e:
        resolve(x_ferry_expert_budget="0")
    assert e.value.status == 400 and e.value.param == "x-ferry-expert-budget"


def test_the_policy_becomes_the_request_once_with_its_own_shadow_key() -> None:
    policy = resolve("safe", x_ferry_speculation="off", x_ferry_expert_budget="3")
    a, b = (policy.request(rid, [5, 6, 7], SamplingParams()) for rid in ("a", "b"))
    assert (a.tenant, a.speculation, a.expert_budget) == ("safe", False, 3)
    assert a.shadow_salt is not None and len(a.shadow_salt) == 32 and a.shadow_salt != b.shadow_salt
    assert resolve("acme").request("c", [1, 2], SamplingParams()).shadow_salt is None  # recompute: no shadows
