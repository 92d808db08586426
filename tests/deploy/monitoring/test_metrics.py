"""deploy/metrics.py with Ray's metric classes swapped for recording fakes: what each timeline,
refusal and stats snapshot turns into, exactly."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest

from actors.engine.output import EngineStats, RequestOutput
from actors.engine.sampling import SamplingParams
from actors.errors import NoCapacity
from actors.messages import RequestPolicy, WorkerLoad
from actors.prefix_cache.stats import PrefixCacheStats, TenantUse
from actors.semantic_cache.stats import SIMILARITY_EDGES, SemanticCacheStats
from cluster.stats import SchedulerStats
from deploy import metrics
from actors.errors import Refused
from deploy.dashboard.monitoring import Monitoring
from deploy.metrics import ClusterMetricsExporter, ClusterSnapshot, RequestMetrics, exported_names
from deploy.openai.hooks import AppHooks, refusal_reason
from deploy.openai.timeline import TimelineRecorder
from tests.deploy.monitoring.fake_metrics import Recorded, install
from tests.deploy.monitoring.test_provider import PREFILL, timeline
from transfer.transport import PeerStats, TransportStats


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    return install(monkeypatch)


def test_a_finished_timeline_becomes_histogram_observations_and_counts(rec: Recorded) -> None:
    m = RequestMetrics()
    m.on_finished(timeline("r1", "acme", 1000.0, [50.0, 60.0, 75.0], "stop", prompt=32, cached=16))
    assert rec.observed("ferry_ttft_ms", tenant="acme") == [50.0]
    assert rec.observed("ferry_tpot_ms", tenant="acme") == [12.5]
    assert rec.observed("ferry_itl_ms", tenant="acme") == [10.0, 15.0]
    assert rec.observed("ferry_e2e_ms", tenant="acme") == [75.0]
    assert rec.increments("ferry_requests") == [1]
    assert rec.total("ferry_requests", tenant="acme", finish_reason="stop") == 1
    assert rec.total("ferry_prompt_tokens", tenant="acme") == 32
    assert rec.total("ferry_output_tokens", tenant="acme") == 3
    assert rec.increments("ferry_kv_transfer_wire_bytes") == []  # colocated: no prefill report


def test_the_kv_transfer_bytes_are_counted_by_node_pair(rec: Recorded) -> None:
    crossed = {**PREFILL, "node": "n-prefill", "kv_to": {"worker": "d0", "node": "n-decode", "cross_node": True}}
    RequestMetrics().on_finished(timeline("r", "acme", 0.0, [25.0], "length", prompt=64, prefill=crossed))
    assert rec.total("ferry_kv_transfer_node_bytes", src_node="n-prefill", dst_node="n-decode") == 4096


def test_a_disaggregated_timeline_also_records_the_prefill_report(rec: Recorded) -> None:
    RequestMetrics().on_finished(timeline("r", "acme", 0.0, [25.0], "length", prompt=64, prefill=PREFILL))
    assert rec.observed("ferry_prefill_stage_ms", stage="queue") == [2.0]
    assert rec.observed("ferry_prefill_stage_ms", stage="prefix_lookup") == [3.0]
    assert rec.observed("ferry_prefill_stage_ms", stage="compute") == [10.0]
    assert rec.observed("ferry_prefill_stage_ms", stage="kv_transfer") == [5.0]
    assert rec.total("ferry_kv_transfer_wire_bytes", worker="p0") == 4096
    assert rec.increments("ferry_kv_transfer_node_bytes") == []  # the report names no nodes
    assert (rec.total("ferry_prefix_reused_blocks", tier="hbm"), rec.total("ferry_prefix_reused_blocks", tier="pool")) \
        == (1, 2)
    assert rec.observed("ferry_tpot_ms") == []  # one token: no TPOT


def test_an_aborted_request_counts_as_abort_without_e2e(rec: Recorded) -> None:
    RequestMetrics().on_finished(timeline("r", "acme", 0.0, [40.0, 45.0], None))
    assert rec.observed("ferry_ttft_ms") == [40.0] and rec.observed("ferry_e2e_ms") == []
    assert rec.total("ferry_requests", tenant="acme", finish_reason="abort") == 1


def test_refusal_reasons_stay_a_small_set() -> None:
    assert refusal_reason(Refused("tenant_over_budget", retry_after_s=1.0)) == "tenant_over_budget"
    assert refusal_reason(NoCapacity("no decode worker has room for cmpl-123 now (asked 2)")) == "no_capacity"
    assert refusal_reason(Refused("Queue full: 812 waiting", retry_after_s=1.0)) == "other"


def load(name: str, running: int, free: int, healthy: bool = True, rss_bytes: int = 0, shadow_bytes: int = 0) -> WorkerLoad:
    return WorkerLoad(name, "decode", running, 2, 1, free, 100, 0.004, healthy, rss_bytes, shadow_bytes=shadow_bytes)


def engine(queried: int, hit: int, preempted: int = 0) -> EngineStats:
    return EngineStats(0, 0, 100, 60, 5, queried, hit, preempted, 0, 10, 100, 0.004)


def test_cluster_snapshots_set_gauges_and_add_counter_increases(rec: Recorded) -> None:
    ex = ClusterMetricsExporter()
    peer = PeerStats(sends=2, wire_bytes_sent=1000, raw_bytes_sent=4000, wire_bytes_received=0, timeouts=1,
                     send_latency_ms_p50=3.0, send_latency_ms_p99=9.0, send_latency_ms_max=9.5)
    ex.export(ClusterSnapshot(
        loads=(load("d0", 3, 40, rss_bytes=1 << 30, shadow_bytes=3 << 20), load("d1", 1, 90)), engines={"d0": engine(100, 40)},
        pool=PrefixCacheStats(num_hits_dram=5, num_hits_disk=1, num_misses=4, dram_bytes=2048, bytes_spilled=700,
                              bytes_promoted=300, num_prefetched=4, num_prefetch_used=3, num_dram_refused=5,
                              num_dram_refused_at_max=2, num_dram_evictions=6, num_dram_evictions_share=4),
        transports=(TransportStats("p0", "nixl", {"d0": peer}, transfers_in_flight=1),),
        scheduler=SchedulerStats(num_recovered=2, num_preempted=1, num_refused={"tenant_over_budget": 3},
                                 num_in_flight=4)))
    assert rec.gauge("ferry_worker_requests", worker="d0", kind="decode", state="running") == 3
    assert rec.gauge("ferry_worker_requests", worker="d0", kind="decode", state="waiting") == 2
    assert rec.gauge("ferry_kv_blocks", worker="d0", kind="decode", state="used") == 60
    assert rec.gauge("ferry_kv_blocks", worker="d1", kind="decode", state="free") == 90
    assert rec.gauge("ferry_worker_step_ms", worker="d0", kind="decode") == 4.0
    assert rec.gauge("ferry_worker_rss_bytes", worker="d0", kind="decode") == 1 << 30
    assert rec.gauge("ferry_worker_rss_bytes", worker="d1", kind="decode") is None  # unknown: not exported
    assert rec.gauge("ferry_kv_shadow_bytes", worker="d0", kind="decode") == 3 << 20
    assert rec.total("ferry_prefix_hbm_lookup_tokens", worker="d0") == 100
    assert rec.total("ferry_prefix_hbm_hit_tokens", worker="d0") == 40
    assert [rec.total("ferry_prefix_pool_lookups", tier=t) for t in ("dram", "disk", "miss")] == [5, 1, 4]
    assert rec.gauge("ferry_prefix_pool_bytes", tier="dram") == 2048
    assert [rec.total("ferry_prefix_pool_moved_bytes", move=m) for m in ("spilled", "promoted")] == [700, 300]
    assert [rec.total("ferry_prefix_pool_prefetch_blocks", outcome=o) for o in ("prefetched", "used")] == [4, 3]
    assert [rec.total("ferry_prefix_pool_refused_blocks", tier="dram", reason=r) for r in ("value", "at_max")] == [3, 2]
    assert [rec.total("ferry_prefix_pool_evictions", tier="dram", reason=r) for r in ("any", "share")] == [6, 4]
    assert rec.total("ferry_transfer_bytes", transport="p0", peer="d0", direction="sent") == 1000
    assert rec.total("ferry_transfer_raw_bytes", transport="p0", peer="d0") == 4000
    assert rec.total("ferry_transfer_failures", transport="p0", peer="d0", kind="timeout") == 1
    assert rec.gauge("ferry_transfer_latency_ms", transport="p0", peer="d0", quantile="p99") == 9.0
    assert rec.total("ferry_recoveries") == 2 and rec.total("ferry_scheduler_refusals", reason="tenant_over_budget") == 3
    assert rec.gauge("ferry_scheduler_in_flight") == 4

    # Next poll: d1 is gone, d0's engine counted 50 more lookups and no hits (no zero increments).
    ex.export(ClusterSnapshot(loads=(load("d0", 2, 50),), engines={"d0": engine(150, 40)},
                              pool_tenants={"chat": TenantUse(3 << 20, 5 << 20)}))
    assert rec.gauge("ferry_prefix_pool_tenant_bytes", tenant="chat", tier="disk") == 5 << 20
    ex.export(ClusterSnapshot(loads=(load("d0", 2, 50),), engines={"d0": engine(150, 40)}))
    assert rec.gauge("ferry_prefix_pool_tenant_bytes", tenant="chat", tier="dram") == 0  # all its blocks gone
    assert rec.gauge("ferry_worker_healthy", worker="d1", kind="decode") == 0
    assert rec.gauge("ferry_worker_healthy", worker="d0", kind="decode") == 1
    assert rec.increments("ferry_prefix_hbm_lookup_tokens", worker="d0") == [100, 50]
    assert rec.increments("ferry_prefix_hbm_hit_tokens", worker="d0") == [40]
    # d0 restarted: its counters start again from zero.
    ex.export(ClusterSnapshot(loads=(load("d0", 0, 100),), engines={"d0": engine(20, 5)}))
    assert rec.total("ferry_prefix_hbm_lookup_tokens", worker="d0") == 170
    assert rec.total("ferry_prefix_hbm_hit_tokens", worker="d0") == 45


def semantic(lookups: int, hits: int, decayed: int, size: int, histogram: list[int]) -> SemanticCacheStats:
    return SemanticCacheStats(num_lookups=lookups, num_hits=hits, num_inserts=size + decayed,
                              num_evicted_decay=decayed, num_evicted_capacity=1, size=size,
                              similarity_histogram=histogram)


def test_semantic_cache_stats_become_counters_a_gauge_and_a_similarity_histogram(rec: Recorded) -> None:
    ex = ClusterMetricsExporter()
    ex.export(ClusterSnapshot(semantic=semantic(10, 4, 2, 6, [1, 0, 2, 0, 0, 3, 0, 4])))
    assert (rec.total("ferry_semantic_lookups"), rec.total("ferry_semantic_hits")) == (10, 4)
    assert rec.total("ferry_semantic_inserts") == 8
    assert [rec.total("ferry_semantic_evictions", reason=r) for r in ("decay", "capacity")] == [2, 1]
    assert rec.gauge("ferry_semantic_entries") == 6
    # Each bucket's count observed at its upper edge: (-inf, 0.5] once, (0.9, 0.95] never, (0.95, 1] 4 times.
    assert rec.observed("ferry_semantic_similarity") == [0.5, 0.7, 0.7, 0.9, 0.9, 0.9, 1.0, 1.0, 1.0, 1.0]
    # Next poll: only the increases; the cache restarted between (counters back to zero) counts whole.
    ex.export(ClusterSnapshot(semantic=semantic(13, 5, 2, 7, [1, 0, 2, 0, 0, 3, 1, 5])))
    assert rec.increments("ferry_semantic_lookups") == [10, 3] and rec.increments("ferry_semantic_evictions",
                                                                                   reason="decay") == [2]
    assert rec.observed("ferry_semantic_similarity")[10:] == [0.95, 1.0]
    ex.export(ClusterSnapshot(semantic=semantic(2, 1, 0, 7, [0] * 7 + [1])))
    assert rec.total("ferry_semantic_lookups") == 15 and rec.gauge("ferry_semantic_entries") == 7
    assert rec.observed("ferry_semantic_similarity")[12:] == [1.0]
    assert SIMILARITY_EDGES == tuple(metrics.SEMANTIC_METRICS["ferry_semantic_similarity"].boundaries)


class Flaky:
    def __init__(self) -> None:
        self.fail = False

    async def stats(self) -> SemanticCacheStats:
        if self.fail:
            raise TimeoutError("the cache actor is busy")
        return semantic(3, 1, 0, 1, [0] * 8)


def test_monitoring_snapshots_carry_the_semantic_cache_stats_when_it_answers() -> None:
    source = Flaky()
    monitoring = Monitoring(Scripted(), semantic=source)
    assert asyncio.run(monitoring.snapshot()).semantic == semantic(3, 1, 0, 1, [0] * 8)
    source.fail = True
    assert asyncio.run(monitoring.snapshot()).semantic is None  # left out; the rest still exported
    assert asyncio.run(Monitoring(Scripted()).snapshot()).semantic is None


def test_monitoring_snapshots_carry_the_prefix_pools_stats_and_tenants(tmp_path: Path) -> None:
    from actors.prefix_cache.config import PrefixCacheConfig
    from actors.prefix_cache.handles import LocalStoreHandle
    from actors.prefix_cache.store import PrefixCacheStore
    from deploy.pool_source import PoolSource

    store = PrefixCacheStore(PrefixCacheConfig(dram_bytes=4 << 20, disk_dir=str(tmp_path)), "s0")
    store.put([(1, bytes(1 << 20))], tenant="chat")
    assert store.get_prefix([1, 2])
    snap = asyncio.run(Monitoring(Scripted(), pool=PoolSource({"s0": LocalStoreHandle(store)})).snapshot())
    assert snap.pool is not None and (snap.pool.num_hits_dram, snap.pool.num_misses) == (1, 1)
    assert snap.pool_tenants == {"chat": TenantUse(1 << 20, 0)}


class Scripted:
    """An HTTP backend that streams three tokens 10 ms apart, or refuses some tenants."""

    model_name, max_model_len, tokenizer = "tiny", 64, None

    def __init__(self) -> None:
        self.timelines = TimelineRecorder()
        self.closed: list[str] = []

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       policy: RequestPolicy) -> AsyncGenerator[RequestOutput, None]:
        if policy.tenant == "throttled":
            raise Refused("tenant_over_budget", retry_after_s=2.0)
        trace = self.timelines.open(request_id, policy.tenant)
        try:
            for i in range(3):
                last = i == 2
                out = RequestOutput(request_id, (i,), "x", "x" * (i + 1), tuple(range(i + 1)), finished=last,
                                    finish_reason="stop" if last else None,
                                    num_prompt_tokens=len(prompt_token_ids), time=trace.arrival + 0.010 * (i + 1))
                trace.on_output(out)
                yield out
        finally:
            self.closed.append(request_id)

    def timeline(self, request_id: str) -> dict[str, Any] | None:
        return self.timelines.get(request_id)

    async def health(self) -> dict[str, Any]:
        return {"healthy": True}


def test_the_apps_hooks_record_finished_aborted_and_refused_requests(rec: Recorded) -> None:
    backend = Scripted()
    hooks, metrics = AppHooks(), RequestMetrics()
    hooks.observers.append(metrics)
    params = SamplingParams(max_tokens=3)

    def run(rid: str, tenant: str) -> AsyncGenerator[RequestOutput, None]:  # what each endpoint does
        return hooks.observed(backend.generate(rid, [1] * (2 + len(rid) - 1), params, policy=RequestPolicy(tenant)),
                              rid, backend.timeline)

    async def main() -> None:
        outs = [o async for o in run("a", "acme")]
        assert [o.finished for o in outs] == [False, False, True]
        stream = run("bb", "acme")
        await stream.__anext__()
        await stream.aclose()  # the client left after the first token
        with pytest.raises(Refused) as e:
            await run("c", "throttled").__anext__()
        hooks.refused("throttled", e.value)  # where the app maps it to HTTP

    asyncio.run(main())
    assert backend.closed == ["a", "bb"]  # closing the observed stream closed (aborted) the backend's
    assert rec.total("ferry_requests", tenant="acme", finish_reason="stop") == 1
    assert rec.total("ferry_requests", tenant="acme", finish_reason="abort") == 1
    assert rec.observed("ferry_ttft_ms", tenant="acme") == [pytest.approx(10.0), pytest.approx(10.0)]
    assert rec.observed("ferry_e2e_ms", tenant="acme") == [pytest.approx(30.0)]
    assert rec.total("ferry_prompt_tokens", tenant="acme") == 5
    assert rec.total("ferry_refusals", tenant="throttled", reason="tenant_over_budget") == 1
    assert metrics.refusals() == {"tenant_over_budget": 1}


def test_every_declared_metric_is_created_and_named_as_ray_exports_it(rec: Recorded) -> None:
    RequestMetrics(), ClusterMetricsExporter()
    assert set(rec.kinds) == set(metrics.REQUEST_METRICS) | set(metrics.CLUSTER_METRICS) | set(metrics.SEMANTIC_METRICS)
    names = exported_names()
    assert {"ray_ferry_ttft_ms_bucket", "ray_ferry_refusals_total", "ray_ferry_kv_blocks"} <= names
    assert "ray_ferry_ttft_ms" not in names and "ray_ferry_kv_blocks_total" not in names
    assert {"ray_ferry_semantic_hits_total", "ray_ferry_semantic_similarity_bucket", "ray_ferry_semantic_entries"} <= names


OUTSIDE_RAY = """
import ray
from deploy.metrics import ClusterMetricsExporter, ClusterSnapshot, RequestMetrics
from tests.deploy.monitoring.test_metrics import engine, load
from tests.deploy.monitoring.test_provider import timeline
RequestMetrics().on_finished(timeline("r", "acme", 0.0, [5.0, 6.0], "stop"))
ClusterMetricsExporter().export(ClusterSnapshot(loads=(load("d0", 1, 10),), engines={"d0": engine(4, 2)}))
assert not ray.is_initialized()
print("recorded")
"""


def test_recorders_work_outside_ray_with_the_real_classes() -> None:
    # A fresh interpreter: in a full test run another folder's session may have started Ray here.
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run([sys.executable, "-c", OUTSIDE_RAY], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "recorded", done.stderr[-2000:]
