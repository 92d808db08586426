"""The dashboard's routes over HTTP, after real requests: the JSON carries the real figures, the
metrics saw every request and the periodic export ran, and the page loads nothing from elsewhere."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx2
import pytest
from fastapi import FastAPI

from deploy.dashboard import DashboardData, mount_dashboard
from deploy.dashboard.model import Throughput
from tests.deploy.monitoring.conftest import NUM_BLOCKS, Served, ServerThread
from tests.deploy.ops.conftest import ferry


def test_data_reports_the_requests_that_ran(traffic: Served) -> None:
    data = httpx2.get(traffic.base_url + "/dashboard/data", timeout=10).json()
    tenants = {t["tenant"]: t for t in data["tenants"]}
    assert sorted(tenants) == ["tenant-a", "tenant-b"]  # refused requests leave no timeline
    a, b = tenants["tenant-a"], tenants["tenant-b"]
    assert (a["num_completed"], a["num_running"], a["num_output_tokens"]) == (3, 0, 4 + 6 + 8)
    assert a["slo"] == {"ttft_ms": 2000.0, "tpot_ms": 500.0} and b["slo"] is None and b["slo_attainment"] is None
    assert b["num_completed"] == 2
    for t in (a, b):
        assert 0 < t["ttft_p50_ms"] <= t["ttft_p99_ms"] and 0 < t["tpot_p50_ms"] <= t["tpot_p99_ms"]
    assert data["throughput"]["num_completed"] == 5 and data["refusals"] == {"tenant_over_budget": 1}
    assert len(data["recent"]) == 5 and {s["stage"] for r in data["recent"] for s in r["stages"]} == {
        "queue_prefill", "decode"}
    stats = traffic.engine.stats()
    assert data["workers"][0].pop("rss_mib") > 10  # the engine runs in this process
    assert data["workers"] == [{
        "name": "engine-0", "kind": "colocated", "healthy": True, "num_running": 0, "num_waiting": 0,
        "num_reserved": 0, "kv_blocks_used": stats.num_blocks_used, "kv_blocks_total": NUM_BLOCKS,
        "last_step_ms": stats.last_step_s * 1e3, "kv_blocks_by_tenant": dict(stats.kv_blocks_by_tenant),
        "offloaded_mib": 0.0, "spec_method": "off", "spec_acceptance": None}]
    # Their cached prompts stay charged to the tenants that computed them.
    assert {t: n > 0 for t, n in stats.kv_blocks_by_tenant if t} == {"tenant-a": True, "tenant-b": True}
    assert {t["tenant"]: t["kv_blocks"] for t in data["tenants"]} == {
        t: n for t, n in stats.kv_blocks_by_tenant if t}
    # The engine's own counters, since the dashboard started (it started with the engine).
    hbm = {t["tier"]: t for t in data["tiers"]}["hbm"]
    assert (hbm["hits"], hbm["lookups"]) == (stats.num_prefix_hit_tokens, stats.num_prefix_queried_tokens)
    assert hbm["hits"] >= 2 * 32  # the 2nd and 3rd tenant-a requests reused two full blocks each


def test_health_and_ferry_status_report_each_tenants_slo_attainment(
        traffic: Served, capsys: pytest.CaptureFixture[str]) -> None:
    health = httpx2.get(traffic.base_url + "/health", timeout=10).json()
    assert health["healthy"] is True and health["slo"]["window_s"] > 0
    a, b = health["slo"]["tenants"]["tenant-a"], health["slo"]["tenants"]["tenant-b"]
    # The tiny model on CPU answers far inside tenant-a's 2 s / 500 ms: all three met both targets.
    assert (a["ttft_slo_ms"], a["tpot_slo_ms"], a["completed"], a["attainment"]) == (2000.0, 500.0, 3, 1.0)
    assert 0 < a["ttft_p99_ms"] < 2000.0 and 0 < a["tpot_p99_ms"] < 500.0
    assert (b["ttft_slo_ms"], b["completed"], b["attainment"]) == (None, 2, None)  # no SLO configured
    assert ferry(["status", "--url", traffic.base_url]) == 0
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("SLO attainment over the last "))
    rows = {line.split()[0]: line.split() for line in out[at + 2:]}
    assert rows["tenant-a"][:8] == ["tenant-a", "2,000", "ms", "500", "ms", "3", "0", "100.0%"]
    assert rows["tenant-b"][:7] == ["tenant-b", "-", "-", "2", "0", "no", "SLO"]


def test_requests_and_engine_stats_reached_the_metrics(traffic: Served) -> None:
    rec, stats = traffic.recorded, traffic.engine.stats()
    assert rec.total("ferry_requests", tenant="tenant-a", finish_reason="length") == 3
    assert rec.total("ferry_output_tokens", tenant="tenant-a") == 18
    assert rec.total("ferry_prompt_tokens", tenant="tenant-a") == 3 * 40
    assert len(rec.observed("ferry_ttft_ms", tenant="tenant-b")) == 2
    assert len(rec.observed("ferry_itl_ms", tenant="tenant-a")) == 3 + 5 + 7
    assert rec.total("ferry_refusals", tenant="throttled", reason="tenant_over_budget") == 1
    # The lifespan task exported the engine: gauges as the engine is now, counters summing to its totals.
    tags = {"worker": "engine-0", "kind": "colocated"}
    assert rec.gauge("ferry_kv_blocks", **tags, state="free") == stats.num_blocks_free
    assert rec.gauge("ferry_worker_healthy", **tags) == 1
    assert rec.total("ferry_prefix_hbm_hit_tokens", worker="engine-0") == stats.num_prefix_hit_tokens


def test_the_page_is_self_contained(served: Served) -> None:
    r = httpx2.get(served.base_url + "/dashboard", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    page = r.text
    assert re.findall(r"\b(?:src|href)\s*=", page) == [] and "<link" not in page and "@import" not in page
    # The only URL in the page is the SVG namespace, an identifier that is never fetched.
    assert re.findall(r"https?://[^\s\"']+", page) == ["http://www.w3.org/2000/svg"]
    assert "/dashboard" not in httpx2.get(served.base_url + "/openapi.json", timeout=10).json()["paths"]


class Constant:
    async def dashboard_data(self) -> DashboardData:
        return DashboardData(1.0, 60.0, Throughput(1.0, 0, 0, 0.0, 0.0), [], [], [], {}, [])


@pytest.fixture(scope="module")
def keyed() -> Iterator[str]:
    app = FastAPI()
    mount_dashboard(app, Constant(), path="/ops/dashboard", access_key="s3cret")
    with ServerThread(app) as server:
        yield server.base_url + "/ops/dashboard"


@pytest.mark.parametrize("suffix", ["", "/data"])
def test_an_access_key_guards_both_routes(keyed: str, suffix: str) -> None:
    assert httpx2.get(keyed + suffix, timeout=10).status_code == 401
    assert httpx2.get(keyed + suffix + "?key=wrong", timeout=10).status_code == 401
    assert httpx2.get(keyed + suffix + "?key=s3cret", timeout=10).status_code == 200
    assert httpx2.get(keyed + suffix, headers={"Authorization": "Bearer s3cret"}, timeout=10).status_code == 200


def test_mount_rejects_bad_paths_and_empty_keys() -> None:
    with pytest.raises(ValueError, match="path"):
        mount_dashboard(FastAPI(), Constant(), path="/dashboard/")
    with pytest.raises(ValueError, match="access_key"):
        mount_dashboard(FastAPI(), Constant(), access_key=" ")
