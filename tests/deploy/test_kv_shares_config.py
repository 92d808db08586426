"""A tenant's KV shares, from the scheduler section to every engine and every prefix-pool store."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from actors.engine.shares import TenantShare
from deploy.config import AppConfig
from deploy.scheduler_config import SchedulerSection


def test_tenant_shares_reach_the_engines_and_the_pool_tiers() -> None:
    sched = SchedulerSection.model_validate({"tenants": {
        "chat": {"kv_share_guaranteed": 0.4, "kv_share_max": 0.8}, "bulk": {"kv_share_max": 0.5}}})
    app = AppConfig.model_validate({"engine": {"max_offload_mib": 64}})
    engine = app.to_worker_config(None, sched.worker_policies()).engine
    cache = app.to_cache_config(sched.kv_shares())
    assert cache is not None
    for shares in (engine.tenant_kv_shares, cache.tenant_shares):
        assert shares.of("chat") == TenantShare(0.4, 0.8) and shares.of("bulk") == TenantShare(0.0, 0.5)
        assert shares.of("someone-else") == TenantShare()  # the default tenant's: no guarantee, no ceiling
    assert engine.max_offload_bytes == 64 << 20
    # Without shares nothing changes: every tenant shares the whole store, as before.
    assert not AppConfig().to_worker_config(None).engine.tenant_kv_shares.enabled


@pytest.mark.parametrize("tenants, why", [
    ({"a": {"kv_share_guaranteed": 0.6, "kv_share_max": 0.5}}, "above kv_share_max"),
    ({"a": {"kv_share_guaranteed": 0.6}, "b": {"kv_share_guaranteed": 0.5}}, "more than the whole store"),
])
def test_shares_that_cannot_hold_are_refused(tenants: dict[str, object], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        SchedulerSection.model_validate({"tenants": tenants})
