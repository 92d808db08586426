"""SchedulerService: the `GlobalScheduler` behind the calls an ingress makes (the scheduler actor).

Mental model: a plain class (Ray-free, torch-free) that `cluster/actor.py` wraps in three lines.
The ingress calls
    submit(desc, seed, client)           -> Placement | Refusal      once per new request
    report(client, batches, loads, telemetry, delivered) -> ReportAck  every ~100 ms: heartbeats
                                            (worker loads), batched events, the workers' step
                                            times and prefix changes, restart detection, and
                                            the notices for this ingress (below)
    recover(client, dead, states)        -> [Placement | Refusal]    its requests that lost a
                                            worker, most urgent remaining SLO budget first
    rebuild(client, states, loads)       after a restart, when an ack asks for it
The scheduler's clock is the wall clock: request arrival and token times come from other
processes, and wall clock is what they share. The service keeps no durable state: a restarted
actor starts empty, learns workers from the next reports and requests from each ingress's
`rebuild`, re-charging each request where it runs (`adopt`), without re-placing it.

Preemption crosses ingresses: an interactive request admitted through one ingress may take the
decode row of a batch request streamed by another. The service remembers which ingress streams
each request (its submit, or the events and states it reports) and queues, per ingress, numbered
notices: "stop these rows" (`ReportAck.preempt`; the submitting ingress also gets its own victims
in `Placement.preempt` at once) and "run this preempted request here" (`ReportAck.resume`, from
`GlobalScheduler.poll`). A notice is re-sent in every acknowledgement until the ingress reports
having seen it (`delivered`), so a lost acknowledgement loses nothing.

Every method runs to completion without awaiting, so the scheduler, which is not thread-safe,
needs nothing more than the actor's one-call-at-a-time execution.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster.admission import Refusal, RefusalReason
from cluster.bookings import Booking
from cluster.clock import WallClock
from cluster.config import SchedulerConfig
from cluster.descriptors import RequestDesc, RequestId, WorkerReport, WorkerName, WorkerTelemetry
from cluster.flights import EventKind, FlightEvent, FlightState, ReportAck
from cluster.journal import JournalEntry, Phase
from cluster.ordering import latest_start_s
from cluster.placement import Placement
from cluster.scaling import ScaleAdvice
from cluster.scheduler import GlobalScheduler
from cluster.stats import SchedulerStats
from cluster.timeline import Stage

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServiceStats:
    incarnation: str = ""
    num_reports: int = 0
    num_telemetry: int = 0  # worker telemetry windows received
    num_events: int = 0
    num_duplicate_batches: int = 0
    num_rebuilds: int = 0
    num_adopted: int = 0
    num_recover_calls: int = 0
    num_expired: int = 0
    num_notices: int = 0  # preempt and resume orders queued for ingresses
    num_orphans: int = 0  # preempted requests resumed with no ingress to run them: cancelled


class SchedulerService:
    def __init__(self, cfg: SchedulerConfig, poll_interval_s: float = 0.2) -> None:
        self.cfg = cfg
        self.clock = WallClock()
        self.sched = GlobalScheduler(cfg, self.clock)
        self.poll_interval_s = poll_interval_s
        self.counters = ServiceStats(incarnation=uuid.uuid4().hex[:12])
        self._rebuilt: set[str] = set()  # clients that gave this incarnation their in-flight list
        self._applied: dict[str, int] = {}  # client -> last event batch applied
        self._last_poll = float("-inf")
        self._owners: dict[RequestId, str] = {}  # request -> the ingress that streams it
        self._notices: dict[str, list[tuple[int, RequestId | Placement]]] = {}  # client -> unseen, in order
        self._notice_seq = 0
        logger.info("scheduler service up (incarnation %s)", self.counters.incarnation)

    @property
    def incarnation(self) -> str:
        return self.counters.incarnation

    # ---- the ingress's calls -----------------------------------------------------------------

    def submit(self, desc: RequestDesc, seed: int | None = None, client: str | None = None) -> Placement | Refusal:
        """Admit and place one request of `client` (None: an anonymous caller, which gets its
        victims in `Placement.preempt` and no notices). Victims streamed by other ingresses are
        queued for them."""
        if self.sched.journal.get(desc.request_id) is not None:  # a retried submit: decide again
            self.sched.cancel(desc.request_id)
        out = self.sched.submit(desc, seed=seed)
        if isinstance(out, Placement):
            if client is not None:
                self._owners[desc.request_id] = client
            for victim in out.preempt:
                owner = self._owners.get(victim)
                if owner is not None and owner != client:
                    self._notify(owner, victim)
        return out

    def _notify(self, client: str, notice: RequestId | Placement) -> None:
        self._notice_seq += 1
        self._notices.setdefault(client, []).append((self._notice_seq, notice))
        self.counters.num_notices += 1

    def report(self, client: str, batches: Sequence[tuple[int, Sequence[FlightEvent]]],
               loads: Sequence[WorkerReport] = (), telemetry: Sequence[WorkerTelemetry] = (),
               delivered: tuple[str, int] | None = None) -> ReportAck:
        """Heartbeats, worker telemetry and events of one ingress. Batches at or below the last
        applied sequence number were applied before (a re-send after a timeout) and are skipped.
        Until `client` has rebuilt this incarnation, its events are dropped: the rebuild
        supersedes them. `delivered`: (incarnation, last notice number) the ingress has seen;
        notices up to it are not sent again."""
        self.counters.num_reports += 1
        if delivered is not None and delivered[0] == self.incarnation and client in self._notices:
            self._notices[client] = [n for n in self._notices[client] if n[0] > delivered[1]]
        for load in loads:
            self.sched.on_report(load)
        for t in telemetry:
            self.sched.on_telemetry(t)
        self.counters.num_telemetry += len(telemetry)
        last = self._applied.get(client, 0)
        if client in self._rebuilt:
            for seq, events in batches:
                if seq <= last:
                    self.counters.num_duplicate_batches += 1
                    continue
                for event in events:
                    self._owners[event.request_id] = client
                    self._apply(event)
                self.counters.num_events += len(events)
                last = seq
        elif batches:
            last = max(seq for seq, _ in batches)
        self._applied[client] = last
        expired: tuple[RequestId, ...] = ()
        now = self.clock.now()
        if now - self._last_poll >= self.poll_interval_s:
            self._last_poll = now
            result = self.sched.poll()
            expired = tuple(r.request_id for r in result.expired)
            self.counters.num_expired += len(expired)
            self._deliver_resumed(result.resumed, now)
        pending = self._notices.get(client, ())
        return ReportAck(self.incarnation, client not in self._rebuilt, last, len(self.sched.journal), expired,
                         self.sched.telemetry.cursors(), notice_seq=pending[-1][0] if pending else 0,
                         preempt=tuple(n for _, n in pending if not isinstance(n, Placement)),
                         resume=tuple(n for _, n in pending if isinstance(n, Placement)))

    def _deliver_resumed(self, resumed: Sequence[Placement], now: float) -> None:
        """Queues each resumed request for the ingress streaming it; forgets finished requests."""
        journal = self.sched.journal
        self._owners = {r: c for r, c in self._owners.items() if journal.get(r) is not None}
        for placement in resumed:
            owner = self._owners.get(placement.request_id)
            if owner is None:  # nobody can run it: release it rather than keep its booking forever
                logger.warning("preempted %s has no ingress to resume it; cancelling it", placement.request_id)
                self.counters.num_orphans += 1
                self.sched.cancel(placement.request_id, now)
            else:
                self._notify(owner, placement)

    def _apply(self, event: FlightEvent) -> None:
        s, rid = self.sched, event.request_id
        if event.kind is EventKind.TOKENS:
            for t in event.times:
                s.on_token(rid, t)
        elif event.kind is EventKind.STAGE:
            assert event.stage is not None
            s.on_stage(rid, Stage(event.stage), event.t)
        elif event.kind is EventKind.FINISH:
            s.on_finish(rid, event.t, event.num_output_tokens, event.spec)
        elif event.kind is EventKind.CANCEL:
            s.cancel(rid, event.t)
        else:
            assert event.state is not None
            self.adopt(event.state)

    def rebuild(self, client: str, states: Sequence[FlightState], loads: Sequence[WorkerReport] = ()) -> int:
        """Adopts `client`'s in-flight requests the scheduler does not know (after a restart:
        all of them). Returns how many were adopted."""
        for load in loads:
            self.sched.on_report(load)
        adopted = sum(self.adopt(st) is not None for st in states if self.sched.journal.get(st.request_id) is None)
        for st in states:
            self._owners[st.request_id] = client
        self._rebuilt.add(client)
        self.counters.num_rebuilds += 1
        logger.info("rebuilt %d in-flight requests of %s", adopted, client)
        return adopted

    def recover(self, client: str, dead: Sequence[str], states: Sequence[FlightState]) -> list[Placement | Refusal]:
        """Re-places `states` (requests of `client` that lost state with the `dead` workers),
        most urgent remaining SLO budget first. The scheduler first takes the states as the truth
        (its copy may lag by a batch of events), then runs its own recovery of each dead worker
        (`GlobalScheduler.on_worker_dead`, which also re-places other ingresses' requests there);
        requests not on a dead worker (a retry after a transient failure) follow, by the same key."""
        self.counters.num_recover_calls += 1
        now = self.clock.now()
        results: dict[RequestId, Placement | Refusal] = {}
        order: list[RequestId] = []
        for st in states:
            self._owners[st.request_id] = client
            if self.adopt(st) is None:
                results[st.request_id] = Refusal(st.request_id, RefusalReason.UNKNOWN_TENANT, None,
                                                 f"unknown tenant {st.desc.tenant!r}")
        wanted = {st.request_id for st in states}
        for name in sorted(dead):
            for out in self.sched.on_worker_dead(WorkerName(name)):
                if out.request_id in wanted and out.request_id not in results:
                    results[out.request_id] = out
                    order.append(out.request_id)
        rest = [e for st in states if st.request_id not in results
                and (e := self.sched.journal.get(st.request_id)) is not None]
        rest.sort(key=lambda e: (e.remaining_budget_s(now) - self.sched.recovery.recompute_s(e),
                                 e.desc.arrival_time, e.request_id))
        for entry in rest:
            self.sched.ledger.close(entry.request_id)
            results[entry.request_id] = self.sched.recovery.recover(entry, now, recompute=True)
            order.append(entry.request_id)
        placed = set(order)
        order.extend(r for r in results if r not in placed)  # refusals of unknown tenants last
        return [results[r] for r in order]

    # ---- adoption: the ingress's truth about one request --------------------------------------

    def adopt(self, st: FlightState) -> JournalEntry | None:
        """Journal `st` as it is (workers, phase, tokens) and charge it there (a preempted one
        waits in the resumption queue instead); None for an unknown tenant. A request admitted
        before is not charged its admission again."""
        s, now, rid = self.sched, self.clock.now(), st.request_id
        tenant = s.tenants.get(st.desc.tenant, now)
        if tenant is None:
            return None
        entry = s.journal.get(rid)
        known = entry is not None
        if entry is None:
            entry = JournalEntry.for_request(st.desc, tenant.cfg.slo, self.cfg.batch_deadline_s, seed=st.seed)
            s.journal.add(entry)
            tenant.num_in_flight += 1  # its admission was paid when it was first admitted
            s.fairness.activate(st.desc.tenant, tenant.cfg.weight, now)
            s.timelines.start(rid, st.desc.tenant, st.desc.arrival_time)
            self.counters.num_adopted += 1
        else:
            s.ledger.close(rid)
            s.recovery.drop_preempted(rid)  # the data plane runs it: it is not waiting for resumption
        # Stopped by the ingress itself (an interactive request found no row), not rebuilt.
        newly_preempted = known and st.phase is Phase.PREEMPTED and entry.phase is not Phase.PREEMPTED
        s.journal.move(rid, st.prefill_worker, st.decode_worker, st.phase)
        if st.num_output_tokens != entry.num_output_tokens:
            entry.num_output_tokens = st.num_output_tokens
            entry.output_token_ids.clear()  # ids are journaled by the ingress, not here
        entry.first_token_time = st.first_token_time
        entry.last_token_time = st.last_token_time
        entry.num_recoveries = max(entry.num_recoveries, st.num_recoveries)
        if newly_preempted:
            s.counters.num_preempted += 1
            s.timelines.stamp(rid, Stage.PREEMPTED, now)
        if st.phase is Phase.PREEMPTED:
            s.recovery.queue_preempted(entry, now)
            return entry
        self._charge(entry, tenant.expected_output_tokens(st.desc.max_tokens, self.cfg.placement.default_output_tokens),
                     tenant.cfg.queue_timeout_s, now)
        return entry

    def _charge(self, entry: JournalEntry, expected: int, queue_timeout_s: float, now: float) -> None:
        s = self.sched
        n = entry.desc.num_prompt_tokens + entry.num_output_tokens
        remaining = max(1, expected - entry.num_output_tokens)
        prefill_open = entry.prefill_worker is not None and entry.phase in (Phase.QUEUED, Phase.PREFILLING)
        cost = s.models.get(entry.prefill_worker).predict_prefill(n) if prefill_open else 0.0  # type: ignore[arg-type]
        dview = s.workers.get(entry.decode_worker) if entry.decode_worker is not None else None
        block_size = dview.block_size if dview is not None else self.cfg.placement.hash_block_size
        s.ledger.open(Booking(entry.request_id, entry.slo_class.rank, entry.prefill_worker, cost, entry.decode_worker,
                              -(-(n + remaining) // block_size), n, entry.tpot_s,
                              latest_start_s(now + entry.remaining_budget_s(now), cost), now + queue_timeout_s),
                      prefill=prefill_open, decode_active=entry.phase in (Phase.TRANSFERRING, Phase.DECODING))

    # ---- introspection -----------------------------------------------------------------------

    def scale_advice(self) -> ScaleAdvice | None:
        return self.sched.scale_advice()

    def ping(self) -> str:
        return self.incarnation

    def stats(self) -> SchedulerStats:
        return self.sched.stats()

    def service_stats(self) -> ServiceStats:
        return self.counters

    def timeline(self, rid: str) -> dict[str, Any] | None:
        return self.sched.timeline(RequestId(rid))

    def recent_timelines(self, limit: int = 100) -> list[dict[str, Any]]:
        return self.sched.recent_timelines(limit)

    def snapshot(self) -> dict[str, Any]:
        return self.sched.snapshot()

    def in_flight(self) -> list[str]:
        return sorted(e.request_id for e in self.sched.journal)

    def check_integrity(self) -> None:
        self.sched.check_integrity()
