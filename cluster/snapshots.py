"""Snapshots, rebuild after a restart, statistics and integrity checks of the scheduler's state.

Mental model: the scheduler's durable truth is small: the in-flight requests (the journal, which
the ingress also holds, since it sees every token it streams) and the fairness counters.
Everything else (worker views, cost models, prefix index, per-request bookings) is re-derived:
worker state from the next round of reports, bookings by re-charging each journaled request
according to its phase. So a rebuild = apply reports (the scheduler does), then `restore`:
re-adopt each in-flight request on its workers, and re-place (via the `RecoveryPlanner`) those
whose workers did not report.

`Snapshots` reads that state out (`snapshot`, `stats`, `check_integrity`) and puts it back
(`restore`); `DecodeCapacity` answers how much a decode worker can still take within its rows'
tightest TPOT target, which the statistics report and resumed recomputes are chunked by.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.admission import Refusal
from cluster.bookings import ACTIVE, COMMITTED, Booking
from cluster.cost_model import CostModelBank, chunk_tokens
from cluster.descriptors import WorkerName
from cluster.journal import JournalEntry, Phase
from cluster.ordering import decode_batch_cap, latest_start_s
from cluster.parts import SchedulerParts
from cluster.placement import Placement, PlacementConfig
from cluster.recovery import LostRequest, RecoveryPlanner
from cluster.stats import SchedulerStats, WorkerStats
from cluster.workers import WorkerRegistry

SNAPSHOT_VERSION = 1


class DecodeCapacity:
    """What each decode worker can still take while its steps stay within the tightest TPOT
    target of the rows it runs (`PlacementConfig.decode_tpot_safety` of it)."""

    def __init__(self, cfg: PlacementConfig, workers: WorkerRegistry, models: CostModelBank) -> None:
        self._cfg = cfg
        self._workers = workers
        self._models = models

    def batch_cap(self, name: WorkerName) -> int:
        """The decode batch size worker `name` should not exceed now (its tightest active TPOT)."""
        view = self._workers.get(name)
        if view is None:
            return 0
        model = self._models.get(name)
        return decode_batch_cap(model, view.tpot_targets.min(), view.context_per_row(0.0),
                                self._cfg.decode_tpot_safety, view.max_num_seqs)

    def local_chunk_tokens(self, name: WorkerName, num_rows: int, num_context_tokens: int,
                           num_cached_tokens: int) -> int:
        """Prefill tokens (after `num_cached_tokens` already computed) decode worker `name` may add
        to a step of `num_rows` decode rows reading `num_context_tokens` of KV, so that the step
        stays within its tightest active TPOT target (`PlacementConfig.local_prefill`)."""
        view = self._workers.get(name)
        cfg = self._cfg
        if view is None:
            return 0
        tight = view.tpot_targets.min()
        if tight is None:
            return cfg.max_local_chunk_tokens
        model = self._models.get(name)
        room = cfg.decode_tpot_safety * tight - model.predict_decode_step(num_rows, num_context_tokens)
        return chunk_tokens(model.theta, room, num_cached_tokens, cfg.max_local_chunk_tokens)


class Snapshots:
    """The scheduler's state read out (snapshot, statistics, integrity check) and put back after
    a restart (`restore`). Holds no state of its own: every part belongs to the scheduler."""

    def __init__(self, parts: SchedulerParts, capacity: DecodeCapacity, recovery: RecoveryPlanner) -> None:
        self._cfg = parts.cfg
        self._clock = parts.clock
        self._journal = parts.journal
        self._ledger = parts.ledger
        self._workers = parts.workers
        self._models = parts.models
        self._index = parts.index
        self._tenants = parts.tenants
        self._fairness = parts.fairness
        self._timelines = parts.timelines
        self._latency = parts.latency
        self._counters = parts.counters
        self._capacity = capacity
        self._recovery = recovery

    def snapshot(self) -> dict[str, Any]:
        return {
            "version": SNAPSHOT_VERSION,
            "time": self._clock.now(),
            "journal": self._journal.snapshot(),
            "fairness": self._fairness.snapshot(),
        }

    def restore(self, in_flight: Sequence[JournalEntry], fairness: dict[str, Any] | None,
                now: float) -> list[Placement | Refusal]:
        """Take back the in-flight requests of a previous incarnation (the workers' reports already
        applied): each re-charged where it runs, preempted ones queued for resumption, those whose
        workers did not report re-placed (the returned list, in arrival order)."""
        if fairness:
            self._fairness.restore(fairness)
        alive = {v.name for v in self._workers}
        lost: list[LostRequest] = []
        for entry in sorted(in_flight, key=lambda e: (e.desc.arrival_time, e.request_id)):
            tenant = self._tenants.get(entry.desc.tenant, now)
            if tenant is None:
                continue  # the tenant was removed from the configuration while the scheduler was down
            self._journal.add(entry)
            tenant.num_in_flight += 1  # already paid for at its first admission
            self._fairness.activate(entry.desc.tenant, tenant.cfg.weight, now)
            self._timelines.start(entry.request_id, entry.desc.tenant, entry.desc.arrival_time)
            if entry.phase is Phase.PREEMPTED:
                self._recovery.queue_preempted(entry, now)
                continue
            prefill_needed = entry.phase in (Phase.QUEUED, Phase.PREFILLING, Phase.TRANSFERRING)
            prefill_lost = prefill_needed and entry.prefill_worker not in alive
            decode_lost = entry.decode_worker not in alive
            if prefill_lost or decode_lost:
                recompute = prefill_lost or entry.phase is Phase.DECODING
                lost.append((entry, recompute))
                continue
            self._adopt(entry, now)
        return [self._recovery.recover(e, now, recompute) for e, recompute in lost]

    def _adopt(self, entry: JournalEntry, now: float) -> None:
        """Re-charge a journaled request on the workers it lives on, as its phase says."""
        assert entry.prefill_worker is not None and entry.decode_worker is not None
        tenant = self._tenants.get(entry.desc.tenant, now)
        assert tenant is not None
        expected = tenant.expected_output_tokens(entry.desc.max_tokens, self._cfg.default_output_tokens)
        remaining = max(1, expected - entry.num_output_tokens)
        n = entry.desc.num_prompt_tokens + entry.num_output_tokens
        cost = self._models.get(entry.prefill_worker).predict_prefill(n)
        dview = self._workers.get(entry.decode_worker)
        assert dview is not None
        lst = latest_start_s(now + entry.remaining_budget_s(now), cost)
        b = Booking(entry.request_id, entry.slo_class.rank, entry.prefill_worker, cost, entry.decode_worker,
                    -(-(n + remaining) // dview.block_size), n, entry.tpot_s, lst,
                    now + tenant.cfg.queue_timeout_s)
        self._ledger.open(b, prefill=entry.phase in (Phase.QUEUED, Phase.PREFILLING),
                          decode_active=entry.phase in (Phase.TRANSFERRING, Phase.DECODING))

    def stats(self) -> SchedulerStats:
        c = self._counters
        out = SchedulerStats(
            num_submitted=c.num_submitted, num_placed=c.num_placed, num_finished=c.num_finished,
            num_in_flight=len(self._journal), num_refused=dict(c.num_refused), num_recovered=c.num_recovered,
            num_preempted=c.num_preempted, num_resumed=c.num_resumed, num_expired=c.num_expired,
            num_workers_lost=c.num_workers_lost)
        for q, attr in ((50, "decision_p50_us"), (99, "decision_p99_us"), (100, "decision_max_us")):
            v = self._latency.percentile(q)
            setattr(out, attr, None if v is None else v * 1e6)
        out.served_tokens_by_tenant = {t.tenant_id: self._fairness.served_tokens(t.tenant_id)
                                       for t in self._tenants}
        for v in self._workers:
            out.workers.append(WorkerStats(
                name=v.name, kind=v.kind.value, healthy=v.healthy, prefill_backlog_s=sum(v.backlog_s),
                num_prefill_queued=v.num_prefill_queued, num_decode_committed=v.num_committed,
                num_decode_active=v.num_active, free_blocks=v.free_blocks(),
                decode_batch_cap=self._capacity.batch_cap(v.name) if v.kind.serves_decode else 0,
                step_model_coefficients=v.model.coefficients, step_model_samples=v.model.num_samples))
        return out

    def check_integrity(self) -> None:
        """Accounts equal the sum of the bookings; journal, ledger and index agree."""
        self._index.check_integrity()
        expect: dict[str, list[float]] = {}
        for entry in self._journal:
            b = self._ledger.get(entry.request_id)
            if entry.phase is Phase.PREEMPTED:
                assert b is None, f"{entry.request_id}: preempted but still booked"
                continue
            assert b is not None, f"{entry.request_id}: in flight without a booking"
            if b.prefill_open and b.prefill is not None:
                e = expect.setdefault(b.prefill, [0.0] * 6)
                e[0] += b.prefill_cost_s
                e[1] += 1
            if b.decode is not None and b.decode_state in (COMMITTED, ACTIVE):
                e = expect.setdefault(b.decode, [0.0] * 6)
                e[2 if b.decode_state == COMMITTED else 3] += 1
                e[4 if b.decode_state == COMMITTED else 5] += b.blocks
        assert len(self._ledger) <= len(self._journal), "bookings without journal entries"
        for v in self._workers:
            v.check_integrity()
            e = expect.get(v.name, [0.0] * 6)
            got = [sum(v.backlog_s), v.num_prefill_queued, v.num_committed, v.num_active,
                   v.committed_blocks, v.active_blocks]
            assert abs(got[0] - e[0]) < 1e-6 * max(1.0, e[0]), f"{v.name}: backlog {got[0]} != {e[0]}"
            assert got[1:] == [int(x) for x in e[1:]], f"{v.name}: accounts {got[1:]} != bookings {e[1:]}"
