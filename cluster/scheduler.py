"""GlobalScheduler: admission, placement, ordering, fairness, recovery, in one deterministic object.

Mental model: the scheduler is a state machine driven by calls, reading time only from its
injected clock, so the Ray actor, the tests and the simulator all run this very code.

    submit(desc)         -> Placement | Refusal     budget gate, best workers, SLO gate, priority
    on_report(load)      heartbeat, free blocks, step samples (cost-model fit), prefix holdings
    on_telemetry(t)      a worker's numbered step samples and prefix changes, applied once
    on_stage / on_token  the request moves: prefill start/done, KV delivered, decode admitted
    on_finish / cancel   the request leaves; every account it charged is released
    on_worker_dead(name) -> [Placement | Refusal]   its requests re-placed, most urgent first
    poll()               -> PollResult   missed heartbeats, queue timeouts, resumed batch work
    snapshot() / rebuild(...)            survive a scheduler restart

Per decision the work is O(workers) plus O(log n) heap operations on n requests in flight; no
call scans the in-flight set. Placement and recovery logic live in `placement.py` and
`journal.py`; per-request charges in `bookings.py`; re-placement, preemption and queue timeouts
in `recovery.py` (`RecoveryPlanner`); snapshots, statistics and integrity checks in
`snapshots.py` (`Snapshots`, `DecodeCapacity`). This file builds those parts, hands each the
collaborators it works on, and only sequences them.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.admission import AdmissionController, Refusal, RefusalReason, SloPrediction
from cluster.bookings import Booking, Ledger
from cluster.clock import Clock
from cluster.config import SchedulerConfig
from cluster.cost_model import CostModelBank
from cluster.descriptors import RequestDesc, RequestId, WorkerReport, WorkerName, WorkerTelemetry
from cluster.fairness import FairShareClock
from cluster.journal import Journal, JournalEntry, Phase
from cluster.ordering import new_request_urgency_s, priority_key
from cluster.parts import SchedulerParts
from cluster.placement import Fit, Placement, PlacementKind, PlacementPolicy
from cluster.prefix_index import POOL, PoolHoldings, PrefixIndex, is_pool_store
from cluster.recovery import RecoveryPlanner
from cluster.scaling import ScaleAdvice, ScaleAdvisor, decode_pressure, prefill_pressure
from cluster.snapshots import DecodeCapacity, Snapshots
from cluster.stats import LatencyWindow, SchedulerStats
from cluster.telemetry import TelemetryInbox
from cluster.tenants import InteractiveSlo, Tenant, TenantRegistry
from cluster.timeline import Stage, TimelineStore
from cluster.workers import WorkerRegistry


@dataclass(slots=True)
class PollResult:
    """What `poll` decided: requests to cancel, then placements to carry out (recovered after
    missed heartbeats, preempted batch work resumed), each list most urgent first."""

    expired: list[Refusal] = field(default_factory=list)
    recovered: list[Placement | Refusal] = field(default_factory=list)
    resumed: list[Placement] = field(default_factory=list)


class GlobalScheduler:
    """The control plane's brain. Not thread-safe: one actor (or one event loop) drives it."""

    def __init__(self, cfg: SchedulerConfig, clock: Clock) -> None:
        self.cfg = cfg
        self.clock = clock
        now = clock.now()
        self.tenants = TenantRegistry(cfg.tenants, cfg.default_tenant, now)
        self.admission = AdmissionController(cfg.admission)
        self.models = CostModelBank(cfg.cost_prior)
        self.index = PrefixIndex()
        self.pool_holdings = PoolHoldings(self.index)
        self.telemetry = TelemetryInbox()
        self.workers = WorkerRegistry(cfg.placement.max_num_seqs, self.models)
        self.policy = PlacementPolicy(cfg.placement, self.models, self.index)
        self.ledger = Ledger(self.workers)
        self.journal = Journal()
        self.fairness = FairShareClock(cfg.reference_token_rate)
        self.timelines = TimelineStore(cfg.timeline_max_finished, cfg.timeline_max_tokens)
        self.latency = LatencyWindow(cfg.latency_window)
        self.counters = SchedulerStats()
        self._seq = itertools.count()  # tie-breaks for priorities, timers and the resumption queue
        self.capacity = DecodeCapacity(cfg.placement, self.workers, self.models)
        parts = SchedulerParts(cfg.placement, clock, self.journal, self.ledger, self.workers, self.models, self.index,
                               self.tenants, self.fairness, self.policy, self.timelines, self.latency, self.counters)
        self.recovery = RecoveryPlanner(parts, seq=self._seq, place=self._place, refuse=self._refuse,
                                        chunk_tokens=self.capacity.local_chunk_tokens)
        self.snapshots = Snapshots(parts, self.capacity, self.recovery)
        self.scaling = ScaleAdvisor(cfg.scaling) if cfg.scaling is not None else None
        slos = [t.slo for t in (*cfg.tenants, cfg.default_tenant) if t is not None]
        self._tightest_ttft_s = min((s.ttft_ms for s in slos if isinstance(s, InteractiveSlo)), default=1000.0) / 1e3

    def submit(self, desc: RequestDesc, *, prompt_token_ids: Sequence[int] | None = None,
               sampling: dict[str, Any] | None = None, seed: int | None = None) -> Placement | Refusal:
        """Admit and place a new request, or refuse it with a reason and a retry-after."""
        t0 = time.perf_counter()
        now = self.clock.now()
        self.counters.num_submitted += 1
        tenant = self.tenants.get(desc.tenant, now)
        refusal = self.admission.check_budget(tenant, desc, now)
        if refusal is None:
            assert tenant is not None
            entry = JournalEntry.for_request(desc, tenant.cfg.slo, self.cfg.batch_deadline_s,
                                             prompt_token_ids, sampling, seed)
            out = self._place(entry, tenant, now, PlacementKind.NEW)
        else:
            out = refusal
        if isinstance(out, Refusal):
            self._count_refusal(out)
        self.latency.add(time.perf_counter() - t0)
        return out

    def _place(self, entry: JournalEntry, tenant: Tenant, now: float,
               kind: PlacementKind) -> Placement | Refusal:
        """Choose workers for `entry`, gate NEW requests on their SLO, then commit the choice."""
        desc, rid = entry.desc, entry.request_id
        rank = entry.slo_class.rank
        expected = tenant.expected_output_tokens(desc.max_tokens, self.cfg.placement.default_output_tokens)
        remaining_out = max(1, expected - entry.num_output_tokens)
        num_tokens = desc.num_prompt_tokens + entry.num_output_tokens
        matches = self.index.match(desc.block_hashes) if desc.block_hashes else {}
        if kind is PlacementKind.REDIRECT:
            pview = self.workers.get(entry.prefill_worker) if entry.prefill_worker else None
            prefill_choice = None if pview is None else self.policy.choose_prefill(
                num_tokens, matches, rank, [pview])
        else:
            prefill_choice = self.policy.choose_prefill(num_tokens, matches, rank, self.workers.prefill)
        # A decode worker prefilling for itself can only start sooner when the best prefill
        # worker has work queued (idle, that worker computes as much, in steps without rows).
        local = self.cfg.placement.local_prefill and kind is not PlacementKind.REDIRECT and (
            prefill_choice is None or prefill_choice.wait_s > 0)
        feasible: list[Fit] | None = [] if local else None
        # Rows promised to requests still prefilling count as taken: local prefills booked on a
        # worker beyond its free rows would wait in that engine, never moving to a worker with room.
        decode_choice = self.policy.choose_decode(
            entry.tpot_s, rank == 0, num_tokens + remaining_out, num_tokens, remaining_out,
            self.workers.decode, feasible, count_committed=True)
        if feasible:
            mine = self.policy.choose_local(num_tokens, matches, rank, feasible,
                                            math.inf if prefill_choice is None else prefill_choice.ttft_s)
            if mine is not None:
                prefill_choice, decode_choice = mine
        if prefill_choice is None or decode_choice is None:
            return Refusal(rid, RefusalReason.NO_HEALTHY_WORKER, self.cfg.heartbeat_timeout_s,
                           "no healthy prefill and decode workers")
        elapsed = now - desc.arrival_time
        ttft_s = elapsed + (0.0 if kind is PlacementKind.REDIRECT else prefill_choice.ttft_s)
        tpot_s = decode_choice.step_s + decode_choice.wait_s / max(1, remaining_out - 1)
        if kind is PlacementKind.NEW and self.cfg.slo_admission:
            completion = ttft_s + decode_choice.wait_s + remaining_out * decode_choice.step_s
            w = decode_choice.worker
            alone_tpot = self.models.get(w.name).predict_decode_step(1, num_tokens) / w.tokens_per_step
            alone_ttft = elapsed + prefill_choice.fetch_s + prefill_choice.compute_s
            refusal = self.admission.check_slo(tenant, desc, SloPrediction(
                ttft_s, tpot_s, completion, prefill_choice.wait_s, alone_ttft, alone_tpot))
            if refusal is not None:
                return refusal
        service_s = prefill_choice.fetch_s + prefill_choice.compute_s
        if kind is PlacementKind.NEW:
            urgency = new_request_urgency_s(entry, service_s, remaining_out * decode_choice.step_s)
            lead = (self.fairness.tag(desc.tenant, tenant.cfg.weight, num_tokens + expected, now) - now
                    if self.cfg.fairness else 0.0)
        else:  # recovery and resumption: urgency from the remaining budget, no fairness charge
            urgency, lead = now + entry.remaining_budget_s(now) - service_s, 0.0
        prio = priority_key(entry.slo_class, urgency, lead, next(self._seq))
        victims = tuple(decode_choice.worker.victims.take(decode_choice.num_preempt))
        for victim in victims:
            self.recovery.preempt(victim, now)
        pw, dw = prefill_choice.worker, decode_choice.worker
        phase = Phase.QUEUED if kind is not PlacementKind.REDIRECT else entry.phase
        queue_deadline = now + tenant.cfg.queue_timeout_s
        booking = Booking(rid, rank, pw.name, service_s, dw.name,
                          -(-(num_tokens + remaining_out) // dw.block_size), num_tokens, entry.tpot_s,
                          urgency, queue_deadline, now + prefill_choice.ttft_s)
        redirect_active = kind is PlacementKind.REDIRECT and entry.phase is Phase.TRANSFERRING
        keep_prefill = kind is not PlacementKind.REDIRECT or entry.phase in (Phase.QUEUED, Phase.PREFILLING)
        self.ledger.open(booking, prefill=keep_prefill, decode_active=redirect_active)
        if kind is PlacementKind.NEW:
            self.journal.add(entry)
            self.admission.admit(tenant, desc, now)
            self.fairness.activate(desc.tenant, tenant.cfg.weight, now)
            tl = self.timelines.start(rid, desc.tenant, desc.arrival_time)
            tl.stamp(Stage.ADMITTED, now)
        self.journal.move(rid, pw.name, dw.name, phase)
        if phase is Phase.QUEUED:
            self.recovery.arm_queue_timeout(rid, queue_deadline)
        self.counters.num_placed += kind is PlacementKind.NEW
        return Placement(
            request_id=rid, prefill_worker=pw.name, decode_worker=dw.name, priority=prio, kind=kind,
            resume_from_token=entry.num_output_tokens, ttft_deadline_s=entry.ttft_deadline_s,
            tpot_s=entry.tpot_s, completion_deadline_s=entry.completion_deadline_s,
            predicted_ttft_s=ttft_s, predicted_tpot_s=tpot_s,
            num_prefix_hit_blocks=prefill_choice.hit_blocks, num_pool_blocks=prefill_choice.pool_blocks,
            preempt=victims, local_chunk_tokens=prefill_choice.chunk_tokens)

    def _count_refusal(self, r: Refusal) -> None:
        self.counters.num_refused[r.reason.value] = self.counters.num_refused.get(r.reason.value, 0) + 1

    def _refuse(self, r: Refusal, now: float) -> None:
        """An admitted request could not be placed again, or waited too long: it leaves, refused."""
        self._count_refusal(r)
        self._leave(r.request_id, now, None, completed=False, stage=Stage.REFUSED)

    # ---- events from the data plane ---------------------------------------------------------

    def on_report(self, load: WorkerReport) -> None:
        """A worker's load report (also its heartbeat)."""
        self.workers.upsert(load, self.clock.now())
        if load.steps:
            self.models.observe(load.name, load.steps)
        if load.cached_full is not None:
            self.index.replace(load.name, load.cached_full)
        self.index.remove(load.name, load.cached_removed)
        self.index.add(load.name, load.cached_added)

    def on_telemetry(self, t: WorkerTelemetry) -> None:
        """A known worker's numbered telemetry (relayed by an ingress): its new engine steps fit
        its step-time model, its prefix-cache changes update the index. Repeats and overlaps are
        applied once (`TelemetryInbox`); telemetry of a worker with no view (never reported, or
        declared dead) is dropped. A prefix-pool store's (`pool_store` names) carries only its
        prefix changes, which feed the index's `POOL` holder (`PoolHoldings`)."""
        if is_pool_store(t.name):
            got = self.telemetry.accept(t)
            if got.cached_full is not None:
                self.pool_holdings.replace(t.name, got.cached_full)
            for added, removed in got.changes:
                self.pool_holdings.change(t.name, added, removed)
            return
        view = self.workers.get(t.name)
        if view is None:
            return
        new = self.telemetry.accept(t)
        if new.steps:
            self.models.observe(t.name, new.steps)
            view.observe_steps(new.steps)
        if new.cached_full is not None:
            self.index.replace(t.name, new.cached_full)
        for added, removed in new.changes:
            self.index.remove(t.name, removed)
            self.index.add(t.name, added)

    def on_pool_report(self, added: Sequence[int] = (), removed: Sequence[int] = (),
                       full: frozenset[int] | None = None) -> None:
        """Prefix blocks the shared prefix-cache pool gained or lost, as one whole (the simulator's
        feed; a live pool's stores report one by one through `on_telemetry`)."""
        if full is not None:
            self.index.replace(POOL, full)
        self.index.remove(POOL, removed)
        self.index.add(POOL, added)

    def _refresh_reference_rate(self) -> None:
        rate = sum(self.models.get(w.name).prefill_tokens_per_s() for w in self.workers.prefill)
        self.fairness.set_reference_rate(rate)

    def on_stage(self, rid: RequestId, stage: Stage, t: float | None = None) -> None:
        """A request reached `stage` (prefill start/done, KV delivered, decode admitted, ...)."""
        t = self.clock.now() if t is None else t
        entry = self.journal.get(rid)
        if entry is None:
            return
        self.timelines.stamp(rid, stage, t)
        local = entry.prefill_worker == entry.decode_worker
        if entry.phase is Phase.QUEUED and (stage is Stage.PREFILL_START or (
                local and stage is Stage.DECODE_ADMITTED and entry.num_output_tokens == 0)):
            # A decode worker running a request whole admits it before prefilling it.
            entry.phase = Phase.PREFILLING
        elif stage is Stage.PREFILL_DONE:
            self._prefill_done(entry)
        elif stage in (Stage.KV_TRANSFER_DONE, Stage.DECODE_ADMITTED):
            self._prefill_done(entry)
            entry.phase = Phase.DECODING

    def _prefill_done(self, entry: JournalEntry) -> None:
        if entry.phase in (Phase.QUEUED, Phase.PREFILLING):
            # A prefill on the decode worker itself has no KV to hand over: it decodes at once.
            local = entry.prefill_worker == entry.decode_worker
            entry.phase = Phase.DECODING if local else Phase.TRANSFERRING
        self.ledger.prefill_done(entry.request_id)
        self.ledger.activate_decode(entry.request_id)

    def on_token(self, rid: RequestId, t: float | None = None, token_ids: Sequence[int] = (),
                 count: int = 1) -> None:
        """`count` tokens (ids optional) were streamed to the client at `t`. The first one means
        the prefill is done."""
        t = self.clock.now() if t is None else t
        entry = self.journal.get(rid)
        if entry is None:
            return
        if entry.num_output_tokens == 0 or entry.phase in (Phase.QUEUED, Phase.PREFILLING):
            b = self.ledger.get(rid)
            view = self.workers.get(b.prefill) if b is not None and b.prefill_open and b.prefill else None
            if view is not None and b is not None:
                view.learn_ttft_error(t - b.predicted_first_token_s)
            self.timelines.stamp(rid, Stage.PREFILL_DONE, t)
            self._prefill_done(entry)
        self.journal.record_tokens(rid, t, tuple(token_ids), count)
        for _ in range(len(token_ids) if token_ids else count):
            self.timelines.token(rid, t)

    def on_finish(self, rid: RequestId, t: float | None = None, num_output_tokens: int | None = None,
                  spec: tuple[int, int] | None = None) -> None:
        """The request completed; `spec`: its draft tokens (proposed, accepted), for its timeline."""
        if spec is not None:
            self.timelines.spec(rid, *spec)
        self._leave(rid, self.clock.now() if t is None else t, num_output_tokens, completed=True)

    def cancel(self, rid: RequestId, t: float | None = None) -> None:
        """The client went away or the request was aborted: release it without learning from it."""
        self._leave(rid, self.clock.now() if t is None else t, None, completed=False)

    def _leave(self, rid: RequestId, t: float, num_output_tokens: int | None, *, completed: bool,
               stage: Stage = Stage.FINISHED) -> None:
        entry = self.journal.remove(rid)
        if entry is None:
            return
        self.ledger.close(rid)
        self.recovery.drop_preempted(rid)
        n_out = entry.num_output_tokens if num_output_tokens is None else num_output_tokens
        tenant = self.tenants.get(entry.desc.tenant, t)
        if tenant is not None:
            self.admission.release(tenant, n_out, t - entry.desc.arrival_time, t, completed=completed)
        self.fairness.deactivate(entry.desc.tenant)
        self.timelines.finish(rid, t, stage)
        self.counters.num_finished += completed

    def on_worker_dead(self, name: WorkerName) -> list[Placement | Refusal]:
        """Forget a dead worker and re-place every request that lost state with it, most urgent
        remaining SLO budget first. Requests that cannot be placed anywhere are refused (and
        released)."""
        now = self.clock.now()
        lost = self.recovery.plan(name, now)
        self.counters.num_workers_lost += self.workers.mark_dead(name) is not None
        self.index.drop(name)
        self.models.drop(name)
        self.telemetry.drop(name)
        return [self.recovery.recover(entry, now, recompute) for entry, recompute in lost]

    def poll(self) -> PollResult:
        """Periodic housekeeping: declare silent workers dead, expire requests queued too long,
        resume preempted batch work where a decode row is free."""
        now = self.clock.now()
        result = PollResult()
        self._refresh_reference_rate()
        for name in sorted(self.workers.stale(now, self.cfg.heartbeat_timeout_s)):
            result.recovered.extend(self.on_worker_dead(name))
        result.expired.extend(self.recovery.expire(now))
        result.resumed.extend(self.recovery.resume(now))
        return result

    def scale_advice(self) -> ScaleAdvice | None:
        """Replica counts per role the measured slack asks for (None: scaling not configured)."""
        if self.scaling is None:
            return None
        return self.scaling.advise(self.clock.now(), len(self.workers.prefill),
                                   prefill_pressure(self.workers, self._tightest_ttft_s),
                                   len(self.workers.decode), decode_pressure(self.workers))

    # ---- introspection, snapshot, rebuild ----------------------------------------------------

    def decode_batch_cap(self, name: WorkerName) -> int:
        return self.capacity.batch_cap(name)

    def local_chunk_tokens(self, name: WorkerName, num_rows: int, num_context_tokens: int,
                           num_cached_tokens: int) -> int:
        return self.capacity.local_chunk_tokens(name, num_rows, num_context_tokens, num_cached_tokens)

    def timeline(self, rid: RequestId) -> dict[str, Any] | None:
        return self.timelines.get(rid)

    def recent_timelines(self, limit: int = 100) -> list[dict[str, Any]]:
        return self.timelines.recent(limit)

    def stats(self) -> SchedulerStats:
        return self.snapshots.stats()

    def snapshot(self) -> dict[str, Any]:
        return self.snapshots.snapshot()

    @classmethod
    def rebuild(cls, cfg: SchedulerConfig, clock: Clock, in_flight: Sequence[JournalEntry],
                loads: Sequence[WorkerReport], fairness: dict[str, Any] | None = None,
                ) -> tuple["GlobalScheduler", list[Placement | Refusal]]:
        """A fresh scheduler rebuilt after a restart from the workers' reports and the ingress's
        in-flight list; requests whose workers did not report are re-placed (the returned list)."""
        sched = cls(cfg, clock)
        now = clock.now()
        for load in loads:
            sched.on_report(load)
        return sched, sched.snapshots.restore(in_flight, fairness, now)

    def check_integrity(self) -> None:
        self.snapshots.check_integrity()
        self.pool_holdings.check_integrity()
