"""The whole Serve app on a tiny random Mixtral (prefill and decode workers as deployments): the
ingress starts the routing controller, both workers report expert loads in /health, a table set
through /admin/routing reaches every worker, the admin role keeps tenants out, and a caller's
`x-ferry-expert-budget` is checked against the model and reaches both workers."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.deploy.serving import served_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PORT = 8329
ADMIN = {"Authorization": "Bearer ops-key-1"}
TENANT = {"Authorization": "Bearer sk-acme"}


@pytest.fixture(scope="module")
def tiny_moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from actors.engine.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("serve-moe"), moe=True, seed=3)


def wait_for(check, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def test_tables_reach_every_worker_and_loads_show_in_health(ray_cluster, tiny_moe_model) -> None:
    import httpx2

    cfg = {"model": str(tiny_moe_model), "engine": {"dtype": "float32", "kv_cache_mib": 4, "torch_threads": 1},
           "prefix_cache": {"num_stores": 0}, "transfer": {"staging_mib": 8},
           "api": {"api_keys": {"sk-acme": "acme"}, "admin_keys": {"ops-key-1": "alice"}}}
    with served_app("ferry-moe", PORT, cfg) as url:
        name = tiny_moe_model.name
        r = httpx2.post(f"{url}/v1/completions", headers=TENANT, timeout=60,
                        json={"model": name, "prompt": "The ferry leaves the harbor", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text

        def both_reported():  # type: ignore[no-untyped-def]
            moe = httpx2.get(f"{url}/health", timeout=10).json().get("moe", {})
            workers = moe.get("workers", {})
            return moe if len(workers) == 2 and all(w["tokens_routed"] > 0 for w in workers.values()) else None

        moe = wait_for(both_reported)
        assert moe is not None and moe["table_version"] == 0 and moe["consistent"]
        assert {n.split("-")[1] for n in moe["workers"]} == {"prefill", "decode"}

        assert httpx2.get(f"{url}/admin/routing/{name}", headers=TENANT, timeout=10).status_code == 403
        state = httpx2.get(f"{url}/admin/routing/{name}", headers=ADMIN, timeout=10).json()
        bias = [[-1.0, 0.5, 0.5, 0.0]] * state["num_layers"]
        put = httpx2.put(f"{url}/admin/routing/{name}", headers=ADMIN, json={"bias": bias}, timeout=10)
        assert put.status_code == 200 and put.json()["table"]["version"] == 1
        applied = wait_for(lambda: (s := httpx2.get(f"{url}/admin/routing/{name}", headers=ADMIN, timeout=10).json())
                           ["consistent"] and s)
        assert applied and set(applied["workers"].values()) == {1}
        r = httpx2.post(f"{url}/v1/completions", headers=TENANT, timeout=60,
                        json={"model": name, "prompt": "The capital of France", "max_tokens": 4})
        assert r.status_code == 200
        assert wait_for(lambda: all(w["table_version"] == 1 for w in
                                    httpx2.get(f"{url}/health", timeout=10).json()["moe"]["workers"].values()))
        bad = httpx2.put(f"{url}/admin/routing/{name}", headers=ADMIN, json={"bias": [[float("1e9")] * 4]}, timeout=10)
        assert bad.status_code == 400

        # A caller's expert budget: over the model's 4 experts is a 400 naming the header; 2 is
        # carried to both workers (the prefill worker chooses, the decode worker is given the choice).
        def complete(budget: str) -> httpx2.Response:
            return httpx2.post(f"{url}/v1/completions", headers={**TENANT, "x-ferry-expert-budget": budget},
                               timeout=60, json={"model": name, "prompt": "The ferry leaves the harbor at noon",
                                                 "max_tokens": 6, "temperature": 0})

        over = complete("5")
        assert over.status_code == 400 and over.json()["error"]["param"] == "x-ferry-expert-budget"
        budgeted = complete("2")
        assert budgeted.status_code == 200
        timeline = httpx2.get(f"{url}/v1/requests/{budgeted.json()['id']}/timeline", headers=TENANT, timeout=10).json()
        chosen = timeline["prefill"]["expert_choice"]  # taken by the prefill worker, sent ahead of the KV
        assert len(chosen) == state["num_layers"] and all(len(e) == 2 for e in chosen)
        assert wait_for(lambda: all(w["budgeted_requests"] >= 1 for w in
                                    httpx2.get(f"{url}/health", timeout=10).json()["moe"]["workers"].values()))
