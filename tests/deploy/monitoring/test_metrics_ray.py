"""The real thing: a Ray actor records through deploy/metrics.py, and Ray's metrics export port on
127.0.0.1 serves the series with the names, labels and values the Grafana dashboard expects."""

from __future__ import annotations

import os
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from deploy.metrics import E2E_BUCKETS_MS, TOKEN_BUCKETS_MS, TTFT_BUCKETS_MS, exported_names
from deploy.moe_metrics import moe_exported_names

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def metrics_url() -> Iterator[str]:
    # Must be set before Ray starts: every Ray port binds 127.0.0.1 (see NOTES-ray.md).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:  # report every second (default: every ten) so the test waits less
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                 _system_config={"metrics_report_interval_ms": 1000})
    try:
        yield f"http://127.0.0.1:{ray.nodes()[0]['MetricsExportPort']}/metrics"
    finally:
        if started:
            ray.shutdown()


class Recorder:
    """What a Serve replica does: build the recorders once, feed them for the replica's life."""

    def feed(self, tenant: str, worker: str) -> None:
        from actors.engine.output import EngineStats
        from actors.messages import WorkerLoad
        from deploy.metrics import ClusterMetricsExporter, ClusterSnapshot, RequestMetrics
        from tests.deploy.monitoring.test_provider import timeline

        self.requests, self.cluster = RequestMetrics(), ClusterMetricsExporter()  # kept alive with the actor
        self.requests.on_finished(timeline("r1", tenant, 0.0, [50.0, 60.0, 75.0], "stop", prompt=32))
        self.requests.on_finished(timeline("r2", tenant, 0.0, [700.0, 800.0], "length", prompt=8))
        self.requests.on_refused(tenant, "tenant_over_budget")
        load = WorkerLoad(worker, "decode", 3, 1, 0, 40, 100, 0.002, True)
        for queried, hit in ((100, 40), (150, 40), (20, 5)):  # the last one after a worker restart
            stats = EngineStats(3, 1, 100, 40, 0, queried, hit, 0, 0, 1, 1, 0.002)
            self.cluster.export(ClusterSnapshot(loads=(load,), engines={worker: stats}))


def midpoint(value: float, buckets: tuple[float, ...]) -> float:
    """Ray's exporter keeps bucket counts only and reports a histogram's `_sum` as if every value
    sat at its bucket's midpoint (ray/_private/telemetry/open_telemetry_metric_recorder.py)."""
    edges = (0.0, *buckets)
    for lo, hi in zip(edges, edges[1:]):
        if value <= hi:
            return (lo + hi) / 2
    return buckets[-1] * 2


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    keep = ("tenant", "worker", "state", "finish_reason", "reason", "le", "kind")
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k in keep)): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("ray_ferry_")}


def test_an_actor_s_metrics_are_exported_as_prometheus_series(metrics_url: str) -> None:
    import ray

    tenant, worker = f"t-{uuid.uuid4().hex[:8]}", f"w-{uuid.uuid4().hex[:8]}"
    actor: Any = ray.remote(num_cpus=0)(Recorder).remote()
    ray.get(actor.feed.remote(tenant, worker), timeout=60)

    def of(name: str, **labels: str) -> float | None:
        return series.get((name, frozenset(labels.items())))

    expected = {
        ("ray_ferry_ttft_ms_count", ("tenant", tenant)): 2,
        # 50 and 700 ms, as the midpoints of (25, 50] and (500, 1000]: 37.5 + 750.
        ("ray_ferry_ttft_ms_sum", ("tenant", tenant)): midpoint(50, TTFT_BUCKETS_MS) + midpoint(700, TTFT_BUCKETS_MS),
        ("ray_ferry_tpot_ms_sum", ("tenant", tenant)): midpoint(12.5, TOKEN_BUCKETS_MS) + midpoint(100, TOKEN_BUCKETS_MS),
        ("ray_ferry_itl_ms_count", ("tenant", tenant)): 3,
        ("ray_ferry_e2e_ms_sum", ("tenant", tenant)): midpoint(75, E2E_BUCKETS_MS) + midpoint(800, E2E_BUCKETS_MS),
        ("ray_ferry_prefix_hbm_lookup_tokens_total", ("worker", worker)): 100 + 50 + 20,
        ("ray_ferry_prefix_hbm_hit_tokens_total", ("worker", worker)): 40 + 5,
    }
    deadline = time.monotonic() + 90
    while True:
        series = scrape(metrics_url)
        found = {key: of(key[0], **dict([key[1]])) for key in expected}
        if found == expected or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert found == expected
    assert found[("ray_ferry_ttft_ms_sum", ("tenant", tenant))] == 787.5
    assert of("ray_ferry_ttft_ms_bucket", tenant=tenant, le="50.0") == 1  # le is inclusive
    assert of("ray_ferry_ttft_ms_bucket", tenant=tenant, le="500.0") == 1
    assert of("ray_ferry_ttft_ms_bucket", tenant=tenant, le="1000.0") == 2
    assert of("ray_ferry_requests_total", tenant=tenant, finish_reason="stop") == 1
    assert of("ray_ferry_requests_total", tenant=tenant, finish_reason="length") == 1
    assert of("ray_ferry_refusals_total", tenant=tenant, reason="tenant_over_budget") == 1
    assert of("ray_ferry_prompt_tokens_total", tenant=tenant) == 40
    assert of("ray_ferry_kv_blocks", worker=worker, kind="decode", state="used") == 60
    assert of("ray_ferry_worker_requests", worker=worker, kind="decode", state="waiting") == 1
    # What Grafana is told to query exists. The scrape holds every ferry series this Ray cluster has seen,
    # so an MoE app tested earlier on it (tests/deploy/test_serve_moe.py) adds its series too.
    assert {name for name, _ in series} <= exported_names() | moe_exported_names()
    ray.kill(actor)
