"""Prometheus metrics of ferry, recorded through `ray.util.metrics`.

Mental model: core code only returns stats dataclasses; this module alone turns them into metrics.
Two recorders, each owning its instruments:
- `RequestMetrics` is fed one finished request at a time (its timeline, as the HTTP backends keep
  it) and every refusal: latency histograms per tenant, token and request counters, the prefill
  worker's stage times, transfer bytes, and each transfer's codec with its predicted and actual
  seconds (the HTTP app's hooks feed it: deploy/openai/hooks.py).
- `ClusterMetricsExporter` is fed periodic `ClusterSnapshot`s (worker loads, engine, prefix-pool,
  transport, scheduler and semantic-cache stats; whatever the caller can read). Loads become
  gauges; cumulative counters in the stats become Prometheus counters by adding the increase since
  the previous snapshot (a counter that went backwards means its worker restarted: see window.py).
  The semantic cache's similarity histogram arrives as cumulative bucket counts with the same
  edges as the Prometheus histogram; each bucket's increase is observed at its upper edge, which
  lands in that very bucket (`le` is inclusive).
Ray exports each name as `ray_<name>` (counters `_total`, histograms `_bucket`/`_sum`/`_count`:
`exported_names()`, what deploy/grafana/ferry.json queries); a histogram's `_sum` is computed from
bucket midpoints, so SLO views use quantiles over buckets. Outside Ray the instruments record
nothing (tests need no cluster); they are looked up on `ray.util.metrics` when a recorder is built.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.util import metrics as ray_metrics

from actors.engine.output import EngineStats
from actors.messages import WorkerLoad
from actors.prefix_cache.stats import PrefixCacheStats, TenantUse
from actors.semantic_cache.stats import SIMILARITY_EDGES, SemanticCacheStats
from cluster.stats import SchedulerStats
from deploy.dashboard.records import RequestRecord, record_from_timeline
from deploy.dashboard.window import counter_increase
from transfer.transport import TransportStats

logger = logging.getLogger(__name__)

TTFT_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
TOKEN_BUCKETS_MS = (1, 2.5, 5, 10, 20, 35, 50, 75, 100, 150, 250, 500, 1000, 2500)
E2E_BUCKETS_MS = (50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000, 300000)
STAGE_BUCKETS_MS = (0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000)


@dataclass(frozen=True)
class MetricSpec:
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()


_H, _C, _G = "histogram", "counter", "gauge"
REQUEST_METRICS = {name: MetricSpec(kind, text, tags, buckets) for name, kind, text, tags, buckets in (
    ("ferry_ttft_ms", _H, "Time to first token from arrival at the ingress (ms).", ("tenant",), TTFT_BUCKETS_MS),
    ("ferry_tpot_ms", _H, "Time per output token after the first, per request (ms).", ("tenant",), TOKEN_BUCKETS_MS),
    ("ferry_itl_ms", _H, "Inter-token latency: gap between consecutive tokens (ms).", ("tenant",), TOKEN_BUCKETS_MS),
    ("ferry_e2e_ms", _H, "End-to-end latency of completed requests (ms).", ("tenant",), E2E_BUCKETS_MS),
    ("ferry_requests", _C, "Requests that ended, by finish reason (abort: ended early).",
     ("tenant", "finish_reason"), ()),
    ("ferry_prompt_tokens", _C, "Prompt tokens of ended requests.", ("tenant",), ()),
    ("ferry_output_tokens", _C, "Output tokens streamed.", ("tenant",), ()),
    ("ferry_refusals", _C, "Requests refused at admission (HTTP 429), by reason.", ("tenant", "reason"), ()),
    ("ferry_prefill_stage_ms", _H, "Prefill stage times: queue, prefix_lookup, compute, kv_transfer (ms).", ("stage",),
     STAGE_BUCKETS_MS),
    ("ferry_kv_transfer_wire_bytes", _C, "KV bytes sent prefill -> decode, as on the wire.", ("worker",), ()),
    ("ferry_kv_transfer_node_bytes", _C, "KV bytes sent prefill -> decode, as on the wire, by the Ray nodes of the "
     "sender and the receiver (the same node: no network crossed).", ("src_node", "dst_node"), ()),
    ("ferry_kv_transfers", _C, "KV transfers prefill -> decode by codec, the tenant's KV fidelity (exact, lossy), "
     "and why the codec was chosen: forced (by policy), predicted (fastest), explore.", ("codec", "fidelity", "reason"), ()),
    ("ferry_kv_codec_bytes", _C, "KV bytes prefill -> decode by codec and fidelity: raw (before the codec) and wire "
     "(as sent, headers included).", ("codec", "fidelity", "bytes"), ()),
    ("ferry_kv_codec_ms", _H, "A KV transfer's encode + send + decode time by codec (ms): predicted before it, "
     "actual after it (encode and send measured, decode predicted).", ("codec", "estimate"), STAGE_BUCKETS_MS),
    ("ferry_prefix_reused_blocks", _C, "Prompt blocks a prefill reused, by tier (hbm: its own; pool).", ("tier",), ()),
)}
CLUSTER_METRICS = {name: MetricSpec(kind, text, tags) for name, kind, text, tags in (
    ("ferry_worker_requests", _G, "Requests on a worker by state: running, waiting (queue), reserved.",
     ("worker", "kind", "state")),
    ("ferry_worker_healthy", _G, "1 if the worker answered its last load poll healthy, else 0.", ("worker", "kind")),
    ("ferry_worker_step_ms", _G, "Duration of the worker's last engine step (ms).", ("worker", "kind")),
    ("ferry_kv_blocks", _G, "KV cache blocks of a worker by state: used, free.", ("worker", "kind", "state")),
    ("ferry_worker_rss_bytes", _G, "Resident memory of the worker's process (bytes).", ("worker", "kind")),
    ("ferry_kv_shadow_bytes", _G, "Prefix-pool memory the KV shadows of a worker's running requests hold (bytes).",
     ("worker", "kind")),
    ("ferry_kv_tenant_blocks", _G, "A worker's KV blocks charged to a tenant (in use + its cached prefixes).",
     ("worker", "tenant")),
    ("ferry_kv_offloaded_bytes", _G, "Host memory holding the KV of a worker's offloaded batch requests (bytes).",
     ("worker", "kind")),
    ("ferry_engine_offloads", _C, "Preempted batch requests whose KV an engine moved to host memory.", ("worker",)),
    ("ferry_spec_draft_tokens", _C, "Draft tokens a worker's engine proposed (speculative decoding).", ("worker",)),
    ("ferry_spec_accepted_tokens", _C, "Draft tokens a worker's engine accepted: output tokens that took no step "
     "of their own (over ferry_spec_draft_tokens: the acceptance rate).", ("worker",)),
    ("ferry_prefix_hbm_lookup_tokens", _C, "Prompt tokens looked up in an engine's own prefix cache.", ("worker",)),
    ("ferry_prefix_hbm_hit_tokens", _C, "Prompt tokens found in an engine's own prefix cache.", ("worker",)),
    ("ferry_prefix_pool_lookups", _C, "Pool block lookups by answering tier: dram, disk, miss.", ("tier",)),
    ("ferry_prefix_pool_bytes", _G, "Bytes held by the prefix-cache pool per tier.", ("tier",)),
    ("ferry_prefix_pool_tenant_bytes", _G, "Bytes a tenant's blocks take in each prefix-pool tier (its share).",
     ("tenant", "tier")),
    ("ferry_prefix_pool_moved_bytes", _C, "Pool payload bytes moved: put into dram/disk, spilled (dram -> disk), "
     "promoted (disk -> dram), served from dram/disk.", ("move",)),
    ("ferry_prefix_pool_prefetch_blocks", _C, "Pool blocks a prefetch promoted, and of those read (used) or "
     "evicted unread (wasted).", ("outcome",)),
    ("ferry_prefix_pool_refused_blocks", _C, "Blocks a pool tier would not admit: worth less than what it holds "
     "(value), or their tenant at its maximum share there (at_max).", ("tier", "reason")),
    ("ferry_prefix_pool_evictions", _C, "Blocks leaving a pool tier for room: any, from a tenant above its "
     "guarantee (share), a tenant at its maximum making room for itself (own).", ("tier", "reason")),
    ("ferry_engine_preemptions", _C, "Requests an engine preempted for lack of KV blocks.", ("worker",)),
    ("ferry_transfer_bytes", _C, "KV transport bytes on the wire, by direction.", ("transport", "peer", "direction")),
    ("ferry_transfer_raw_bytes", _C, "KV bytes sent, before compression.", ("transport", "peer")),
    ("ferry_transfer_sends", _C, "KV transfers sent.", ("transport", "peer")),
    ("ferry_transfer_failures", _C, "Failed KV transfers by kind: timeout, peer_gone.", ("transport", "peer", "kind")),
    ("ferry_transfer_latency_ms", _G, "Send latency over recent sends (quantile: p50, p99, max).",
     ("transport", "peer", "quantile")),
    ("ferry_transfer_in_flight", _G, "Transfers in flight on a transport.", ("transport",)),
    ("ferry_recoveries", _C, "Requests resumed on another worker after a worker failure.", ()),
    ("ferry_scheduler_events", _C, "Scheduler events: preempted, resumed, expired, workers_lost.", ("event",)),
    ("ferry_scheduler_refusals", _C, "Requests the cluster scheduler refused, by reason.", ("reason",)),
    ("ferry_scheduler_in_flight", _G, "Requests the scheduler placed and has not seen finish.", ()),
)}
SEMANTIC_METRICS = {name: MetricSpec(kind, text, tags, buckets) for name, kind, text, tags, buckets in (
    ("ferry_semantic_lookups", _C, "Semantic cache lookups (requests that took part).", (), ()),
    ("ferry_semantic_hits", _C, "Semantic cache lookups answered from the cache.", (), ()),
    ("ferry_semantic_inserts", _C, "Finished answers stored in the semantic cache.", (), ()),
    ("ferry_semantic_evictions", _C, "Semantic cache entries deleted, by reason: decay (score below the floor), "
     "capacity (made room).", ("reason",), ()),
    ("ferry_semantic_entries", _G, "Entries in the semantic cache, pinned included.", (), ()),
    ("ferry_semantic_similarity", _H, "Best cosine similarity each semantic lookup found, hit or miss.", (),
     SIMILARITY_EDGES),
)}


def exported_names() -> set[str]:
    """Every series name Ray's exporter produces for ferry's metrics."""
    out: set[str] = set()
    for name, spec in {**REQUEST_METRICS, **CLUSTER_METRICS, **SEMANTIC_METRICS}.items():
        suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}[spec.kind]
        out.update(f"ray_{name}{s}" for s in suffixes)
    return out


def _instruments(specs: Mapping[str, MetricSpec]) -> dict[str, Any]:
    made: dict[str, Any] = {}
    for name, s in specs.items():
        if s.kind == "counter":
            made[name] = ray_metrics.Counter(name, s.description, tag_keys=s.tag_keys)
        elif s.kind == "gauge":
            made[name] = ray_metrics.Gauge(name, s.description, tag_keys=s.tag_keys)
        else:
            made[name] = ray_metrics.Histogram(name, s.description, boundaries=list(s.boundaries), tag_keys=s.tag_keys)
    return made


class RequestMetrics:
    """Per-request observations. Also a dashboard `RefusalSource` (`refusals()`)."""

    def __init__(self) -> None:
        self._m = _instruments(REQUEST_METRICS)
        self._refusals: dict[str, int] = {}

    def on_finished(self, timeline: Mapping[str, Any]) -> None:
        self.observe(record_from_timeline(timeline))

    def observe(self, r: RequestRecord) -> None:
        m, tenant = self._m, {"tenant": r.tenant}
        if r.ttft_ms is not None:
            m["ferry_ttft_ms"].observe(r.ttft_ms, tenant)
        if r.tpot_ms is not None:
            m["ferry_tpot_ms"].observe(r.tpot_ms, tenant)
        for gap_ms in r.itl_ms:
            m["ferry_itl_ms"].observe(gap_ms, tenant)
        if r.completed and r.e2e_ms is not None:
            m["ferry_e2e_ms"].observe(r.e2e_ms, tenant)
        m["ferry_requests"].inc(1, {**tenant, "finish_reason": r.finish_reason or "abort"})
        _inc(m["ferry_prompt_tokens"], r.num_prompt_tokens, tenant)
        _inc(m["ferry_output_tokens"], r.num_output_tokens, tenant)
        p = r.prefill
        if p is not None:
            for stage, ms in (("queue", p.queued_ms), ("prefix_lookup", p.lookup_ms), ("compute", p.compute_ms),
                              ("kv_transfer", p.transfer_ms)):
                m["ferry_prefill_stage_ms"].observe(ms, {"stage": stage})
            _inc(m["ferry_kv_transfer_wire_bytes"], p.kv_wire_bytes, {"worker": p.worker})
            if p.node and p.kv_to_node:
                _inc(m["ferry_kv_transfer_node_bytes"], p.kv_wire_bytes, {"src_node": p.node, "dst_node": p.kv_to_node})
            if p.kv_codec is not None:
                codec = {"codec": p.kv_codec}
                fidelity = {**codec, "fidelity": p.kv_fidelity or "unknown"}
                m["ferry_kv_transfers"].inc(1, {**fidelity, "reason": p.kv_codec_reason or "unknown"})
                _inc(m["ferry_kv_codec_bytes"], p.kv_wire_bytes, {**fidelity, "bytes": "wire"})
                if p.kv_raw_bytes is not None:
                    _inc(m["ferry_kv_codec_bytes"], p.kv_raw_bytes, {**fidelity, "bytes": "raw"})
                for estimate, ms in (("predicted", p.kv_codec_predicted_ms), ("actual", p.kv_codec_actual_ms)):
                    m["ferry_kv_codec_ms"].observe(ms, {**codec, "estimate": estimate})
            _inc(m["ferry_prefix_reused_blocks"], p.num_local_hit_blocks, {"tier": "hbm"})
            _inc(m["ferry_prefix_reused_blocks"], p.num_pool_hit_blocks, {"tier": "pool"})

    def on_refused(self, tenant: str, reason: str) -> None:
        self._m["ferry_refusals"].inc(1, {"tenant": tenant, "reason": reason})
        self._refusals[reason] = self._refusals.get(reason, 0) + 1

    def refusals(self) -> dict[str, int]:
        return dict(self._refusals)


def _inc(counter: Any, value: float, tags: dict[str, str]) -> None:
    if value > 0:  # Ray counters refuse zero increments
        counter.inc(value, tags)


@dataclass(frozen=True)
class ClusterSnapshot:
    """What one poll could read; absent parts are simply not exported this time."""

    loads: Sequence[WorkerLoad] = ()
    engines: Mapping[str, EngineStats] = field(default_factory=dict)  # by worker name
    pool: PrefixCacheStats | None = None  # the pool's total over its stores
    pool_tenants: Mapping[str, TenantUse] = field(default_factory=dict)  # each tenant's bytes per tier
    transports: Sequence[TransportStats] = ()
    scheduler: SchedulerStats | None = None
    semantic: SemanticCacheStats | None = None


class ClusterMetricsExporter:
    """Sets gauges from, and adds counter increases of, each `ClusterSnapshot` it is given."""

    def __init__(self) -> None:
        self._m = _instruments({**CLUSTER_METRICS, **SEMANTIC_METRICS})
        self._totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # last total per series
        self._workers: dict[str, str] = {}  # every worker ever reported -> its kind
        self._kv_tenants: dict[str, set[str]] = {}  # worker -> tenants it ever charged KV blocks to
        self._pool_tenants: set[str] = set()  # tenants that ever held pool blocks

    def _increase(self, name: str, total: float, tags: dict[str, str] | None = None) -> float:
        key = (name, tuple(sorted((tags or {}).items())))
        increase = counter_increase(self._totals.get(key), total)
        self._totals[key] = total
        return increase

    def _add_total(self, name: str, total: float, tags: dict[str, str] | None = None) -> None:
        _inc(self._m[name], self._increase(name, total, tags), tags or {})

    def _pool_flows(self, p: PrefixCacheStats) -> None:
        """The pool's tier traffic: bytes moved, prefetch outcomes, refusals and evictions."""
        for move, n in (("put_dram", p.bytes_put_dram), ("put_disk", p.bytes_put_disk), ("spilled", p.bytes_spilled),
                        ("promoted", p.bytes_promoted), ("served_dram", p.bytes_served_dram),
                        ("served_disk", p.bytes_served_disk)):
            self._add_total("ferry_prefix_pool_moved_bytes", n, {"move": move})
        for outcome, n in (("prefetched", p.num_prefetched), ("used", p.num_prefetch_used),
                           ("wasted", p.num_prefetch_wasted)):
            self._add_total("ferry_prefix_pool_prefetch_blocks", n, {"outcome": outcome})
        for tier in ("dram", "disk"):
            at_max = getattr(p, f"num_{tier}_refused_at_max")
            for reason, n in (("value", getattr(p, f"num_{tier}_refused") - at_max), ("at_max", at_max)):
                self._add_total("ferry_prefix_pool_refused_blocks", n, {"tier": tier, "reason": reason})
            for reason, suffix in (("any", ""), ("share", "_share"), ("own", "_own")):
                self._add_total("ferry_prefix_pool_evictions", getattr(p, f"num_{tier}_evictions{suffix}"),
                                {"tier": tier, "reason": reason})

    def export(self, snap: ClusterSnapshot) -> None:
        m = self._m
        seen = {w.name for w in snap.loads}
        for name, kind in self._workers.items():  # a worker gone from the loads is no longer serving
            if name not in seen:
                m["ferry_worker_healthy"].set(0, {"worker": name, "kind": kind})
        for w in snap.loads:
            self._workers[w.name] = w.kind
            tags = {"worker": w.name, "kind": w.kind}
            for state, n in (("running", w.num_running), ("waiting", w.num_waiting), ("reserved", w.num_reserved)):
                m["ferry_worker_requests"].set(n, {**tags, "state": state})
            m["ferry_worker_healthy"].set(1 if w.healthy else 0, tags)
            m["ferry_worker_step_ms"].set(w.last_step_s * 1e3, tags)
            m["ferry_kv_blocks"].set(w.num_total_blocks - w.num_free_blocks, {**tags, "state": "used"})
            m["ferry_kv_blocks"].set(w.num_free_blocks, {**tags, "state": "free"})
            if w.rss_bytes:
                m["ferry_worker_rss_bytes"].set(w.rss_bytes, tags)
            m["ferry_kv_shadow_bytes"].set(w.shadow_bytes, tags)
            m["ferry_kv_offloaded_bytes"].set(w.offloaded_bytes, tags)
            now = {tenant or "-": n for tenant, n in w.kv_blocks_by_tenant}
            for tenant in self._kv_tenants.setdefault(w.name, set()) | set(now):  # a tenant gone drops to 0
                m["ferry_kv_tenant_blocks"].set(now.get(tenant, 0), {"worker": w.name, "tenant": tenant})
            self._kv_tenants[w.name] |= set(now)
            self._add_total("ferry_spec_draft_tokens", w.num_draft_tokens, {"worker": w.name})
            self._add_total("ferry_spec_accepted_tokens", w.num_accepted_tokens, {"worker": w.name})
        for name, e in snap.engines.items():
            self._add_total("ferry_prefix_hbm_lookup_tokens", e.num_prefix_queried_tokens, {"worker": name})
            self._add_total("ferry_prefix_hbm_hit_tokens", e.num_prefix_hit_tokens, {"worker": name})
            self._add_total("ferry_engine_preemptions", e.num_preemptions, {"worker": name})
            self._add_total("ferry_engine_offloads", e.num_offloads, {"worker": name})
        if snap.pool is not None:
            p = snap.pool
            for tier, n in (("dram", p.num_hits_dram), ("disk", p.num_hits_disk), ("miss", p.num_misses)):
                self._add_total("ferry_prefix_pool_lookups", n, {"tier": tier})
            m["ferry_prefix_pool_bytes"].set(p.dram_bytes, {"tier": "dram"})
            m["ferry_prefix_pool_bytes"].set(p.disk_bytes, {"tier": "disk"})
            self._pool_flows(p)
        if snap.pool_tenants or self._pool_tenants:
            self._pool_tenants |= set(snap.pool_tenants)
            for tenant in self._pool_tenants:  # a tenant whose blocks are all gone drops to 0 bytes
                use = snap.pool_tenants.get(tenant, TenantUse())
                m["ferry_prefix_pool_tenant_bytes"].set(use.dram_bytes, {"tenant": tenant, "tier": "dram"})
                m["ferry_prefix_pool_tenant_bytes"].set(use.disk_bytes, {"tenant": tenant, "tier": "disk"})
        for t in snap.transports:
            self._transport(t)
        if snap.scheduler is not None:
            self._scheduler(snap.scheduler)
        if snap.semantic is not None:
            self._semantic(snap.semantic)

    def _transport(self, t: TransportStats) -> None:
        self._m["ferry_transfer_in_flight"].set(t.transfers_in_flight, {"transport": t.name})
        for peer, s in t.peers.items():
            tags = {"transport": t.name, "peer": peer}
            self._add_total("ferry_transfer_bytes", s.wire_bytes_sent, {**tags, "direction": "sent"})
            self._add_total("ferry_transfer_bytes", s.wire_bytes_received, {**tags, "direction": "received"})
            self._add_total("ferry_transfer_raw_bytes", s.raw_bytes_sent, tags)
            self._add_total("ferry_transfer_sends", s.sends, tags)
            self._add_total("ferry_transfer_failures", s.timeouts, {**tags, "kind": "timeout"})
            self._add_total("ferry_transfer_failures", s.peer_gone, {**tags, "kind": "peer_gone"})
            if s.sends:  # the percentiles of a peer never sent to are placeholders
                for q, ms in (("p50", s.send_latency_ms_p50), ("p99", s.send_latency_ms_p99),
                              ("max", s.send_latency_ms_max)):
                    self._m["ferry_transfer_latency_ms"].set(ms, {**tags, "quantile": q})

    def _scheduler(self, s: SchedulerStats) -> None:
        self._add_total("ferry_recoveries", s.num_recovered)
        for event, n in (("preempted", s.num_preempted), ("resumed", s.num_resumed), ("expired", s.num_expired),
                         ("workers_lost", s.num_workers_lost)):
            self._add_total("ferry_scheduler_events", n, {"event": event})
        for reason, n in s.num_refused.items():
            self._add_total("ferry_scheduler_refusals", n, {"reason": reason})
        self._m["ferry_scheduler_in_flight"].set(s.num_in_flight)

    def _semantic(self, s: SemanticCacheStats) -> None:
        self._add_total("ferry_semantic_lookups", s.num_lookups)
        self._add_total("ferry_semantic_hits", s.num_hits)
        self._add_total("ferry_semantic_inserts", s.num_inserts)
        self._add_total("ferry_semantic_evictions", s.num_evicted_decay, {"reason": "decay"})
        self._add_total("ferry_semantic_evictions", s.num_evicted_capacity, {"reason": "capacity"})
        self._m["ferry_semantic_entries"].set(s.size)
        histogram = self._m["ferry_semantic_similarity"]
        for edge, count in zip(SIMILARITY_EDGES, s.similarity_histogram):
            # Keyed by the edge (not a tag of the metric): the running total of one bucket.
            for _ in range(int(self._increase("ferry_semantic_similarity", count, {"le": str(edge)}))):
                histogram.observe(edge)
