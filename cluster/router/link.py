"""SchedulerLink: the ingress's side of the scheduler actor, the router's `ControlPlane`.

Mental model: the data path never waits on the control plane for more than one bounded call per
request. `admit` asks the actor for a placement with a deadline (`admit_timeout_s`); a refusal
becomes `actors.errors.Refused` (HTTP 429 + Retry-After and friends); no answer (the actor restarting,
or slow) means the router places the request with its local policy and the actor is left alone for
`down_backoff_s`. Everything else is off the hot path: notifications (placed, stages, tokens,
done) are buffered and sent, with the workers' loads as heartbeats, by one background reporter
every `report_interval_s`; unacknowledged batches are re-sent with their sequence numbers. When
there is nothing to tell (no request in flight here or queued at the scheduler, nothing unsent or
unacknowledged), the reporter only heartbeats, every `idle_report_interval_s` (well inside the
scheduler's heartbeat timeout), and wakes at once for the next request's first event. Every
`telemetry_interval_s` the reporter also relays each worker's engine telemetry (step times for
the scheduler's step-time models, prefix-cache changes for its prefix index), read after the
cursors the scheduler's last acknowledgement gave, so the scheduler applies each once (and, when a
prefix-cache pool is attached, each store's holdings the same way, for the index's pool). When
an acknowledgement says the actor does not know this ingress (it restarted), the reporter sends
the in-flight list (`rebuild`), which supersedes every event not yet applied. So requests never
depend on the actor being up, and the actor's view is rebuilt from the ingress's truth.

Preemption is live: the batch rows the scheduler evicts for an interactive request (this
request's `Placement.preempt`, or a notice in a report acknowledgement when another ingress's
request took them) are stopped through the router (`FlightSource.preempt`); rows that cannot stop
now (their KV is still on its way) are re-adopted, so the scheduler knows they still run. When the
scheduler resumes a preempted request (a notice), the router runs it where the placement says.
Notices are numbered; each report says which ones this ingress has seen, so none is lost with an
acknowledgement and none is acted on twice.

Recoveries ask the actor for its plan (most urgent remaining SLO budget first); without it the
same ordering (`Journal.recovery_plan`) is computed here from the tenants' SLOs, and the router
places each request with its local policy.

A request's SLO class is its tenant's, unless the caller downgraded it to batch
(`GenerationRequest.slo_class`, from the `x-ferry-slo-class: batch` header in its `RequestPolicy`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence

from ray.actor import ActorHandle
from ray.exceptions import RayError

from actors.errors import NoWorkers
from actors.handoff import prompt_block_hashes
from actors.messages import GenerationRequest, TelemetryCursor
from cluster.admission import Refusal
from cluster.config import SchedulerConfig
from cluster.descriptors import RequestId
from cluster.flights import EventKind, FlightEvent, FlightState, ReportAck
from cluster.placement import Placement
from cluster.router.adapters import (PoolHoldingsRead, flight_state, pool_cursors, pool_telemetry, refusal_error,
                                     request_desc, telemetry_cursor, worker_load, worker_telemetry)
from cluster.router.control import FlightSource, Planned
from cluster.router.event_buffer import EventBuffer
from cluster.router.flight import PREEMPTED, InFlight
from cluster.router.link_config import LinkConfig, LinkStats
from cluster.router.pacer import ReportPacer
from cluster.router.recovery_order import RecoveryOrder
from cluster.scaling import ScaleAdvice
from cluster.tenants import TenantRegistry

logger = logging.getLogger(__name__)



class SchedulerLink:
    """The router's `ControlPlane` over the scheduler actor (`cluster/actor.py`)."""

    def __init__(self, actor: ActorHandle, cfg: LinkConfig | None = None, sched_cfg: SchedulerConfig | None = None) -> None:
        self.actor = actor
        self.cfg = cfg or LinkConfig()
        sched_cfg = sched_cfg or SchedulerConfig()
        # Idle heartbeats at most a quarter of the scheduler's heartbeat timeout apart: three can be lost.
        self.pacer = ReportPacer(self.cfg.report_interval_s,
                                 min(self.cfg.idle_report_interval_s, sched_cfg.heartbeat_timeout_s / 4))
        self._recovery_order = RecoveryOrder(TenantRegistry(sched_cfg.tenants, sched_cfg.default_tenant),
                                             sched_cfg.batch_deadline_s)
        # Prompt block hashes mean something to the scheduler only in blocks of its own size.
        self._hash_prompts = sched_cfg.placement.hash_block_size == self.cfg.block_size
        if not self._hash_prompts:
            logger.warning("scheduler hash_block_size %d != engine block size %d: no prefix affinity",
                           sched_cfg.placement.hash_block_size, self.cfg.block_size)
        self.preempt_batch = sched_cfg.placement.preempt_batch
        self.stats = LinkStats()
        self._source: FlightSource | None = None
        self._assigned: dict[str, tuple[str | None, str]] = {}  # the scheduler's (prefill, decode)
        self._hashes: dict[str, tuple[int, ...]] = {}  # prompt block hashes of requests in flight
        self._cursors: dict[str, TelemetryCursor] = {}  # the scheduler's, from its last ack
        self._telemetry_at = float("-inf")  # when telemetry was last relayed
        self.telemetry_settled = False  # the last relay, after the last busy round, had nothing new
        self._pool_holdings: PoolHoldingsRead | None = None
        self._events = EventBuffer()  # not sent yet
        self._pending: list[tuple[int, list[FlightEvent]]] = []  # sent, not acknowledged
        self._seq = itertools.count(1)
        self._notices_seen: tuple[str, int] | None = None  # (incarnation, last notice acted on)
        self._down_until = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = asyncio.Event()
        self._reporter: asyncio.Task[None] | None = None
        self._closed = False

    def attach(self, source: FlightSource) -> None:
        self._source = source

    def attach_pool(self, holdings: PoolHoldingsRead) -> None:
        """Relays the prefix-cache pool's holdings (`PrefixCachePool.holdings`, blocking) with the workers'."""
        self._pool_holdings = holdings

    # ---- decisions ---------------------------------------------------------------------------

    async def admit(self, req: GenerationRequest) -> Placement | None:
        self._start()
        stale = self.pacer.idle  # heartbeats only of late: the actor's view of the workers may be old
        self.pacer.poke()
        if self.available:
            try:
                await asyncio.wait_for(self._ready.wait(), self.cfg.ready_timeout_s)
                if stale:
                    await asyncio.wait_for(self.pacer.fresh_round(), self.cfg.ready_timeout_s)
            except asyncio.TimeoutError:
                pass
        if self._hash_prompts:
            self._hashes[req.request_id] = tuple(prompt_block_hashes(req, self.cfg.block_size))
        if self.available:
            desc = request_desc(req, self._hashes.get(req.request_id, ()))
            try:
                out = await asyncio.wait_for(self.actor.submit.remote(desc, req.seed, self.cfg.client_id),
                                             self.cfg.admit_timeout_s)
            except (RayError, asyncio.TimeoutError) as e:
                self._mark_down(e)
            else:
                if isinstance(out, Refusal):
                    self.stats.num_refused += 1
                    raise refusal_error(out)
                self.stats.num_admitted += 1
                self._assigned[req.request_id] = (out.prefill_worker, out.decode_worker)
                if out.preempt:
                    self._preempt(out.preempt)
                return out
        self.stats.num_fallback += 1
        return None

    def fallback_rank(self, req: GenerationRequest) -> int:
        return 1 if req.slo_class == "batch" else 0

    async def recover(self, dead: frozenset[str], flights: Sequence[InFlight]) -> list[tuple[InFlight, Planned]]:
        self._start()
        victims = {f.request_id for f in flights}
        self._events.drop(victims)  # the states supersede them
        if self.available:
            states = [self._state(f) for f in flights]
            try:
                outs = await asyncio.wait_for(
                    self.actor.recover.remote(self.cfg.client_id, sorted(dead), states), self.cfg.call_timeout_s)
            except (RayError, asyncio.TimeoutError) as e:
                self._mark_down(e)
            else:
                self.stats.num_recover_calls += 1
                return self._plan_from(outs, flights)
        self.stats.num_recover_fallback += 1
        return self._local_plan(flights)

    def _plan_from(self, outs: Sequence[Placement | Refusal], flights: Sequence[InFlight]) -> list[tuple[InFlight, Planned]]:
        by_id = {f.request_id: f for f in flights}
        plan: list[tuple[InFlight, Planned]] = []
        for out in outs:
            flight = by_id.pop(out.request_id, None)
            if flight is None:
                continue
            if isinstance(out, Refusal):
                plan.append((flight, refusal_error(out)))
                continue
            self._assigned[flight.request_id] = (out.prefill_worker, out.decode_worker)
            plan.append((flight, out))
        if by_id:  # the scheduler did not answer for them (cannot happen unless it is a newer version)
            plan.extend(self._local_plan(list(by_id.values())))
        return plan

    def _local_plan(self, flights: Sequence[InFlight]) -> list[tuple[InFlight, Planned]]:
        """The scheduler's ordering (`RecoveryOrder`); the router places each with its local policy."""
        return [(flights[i], None) for i in self._recovery_order.order([self._state(f) for f in flights])]

    async def scale_advice(self) -> ScaleAdvice | None:
        """The scheduler's replica counts per role (None: not configured, or the actor is away)."""
        if not self.available:
            return None
        try:
            return await asyncio.wait_for(self.actor.scale_advice.remote(), self.cfg.call_timeout_s)
        except (RayError, asyncio.TimeoutError) as e:
            self._mark_down(e)
            return None

    # ---- notifications (never block, never raise) -------------------------------------------

    def on_placed(self, flight: InFlight) -> None:
        assigned = self._assigned.get(flight.request_id)
        same = (assigned is not None and assigned[1] == flight.decode
                and (flight.prefill is None or assigned[0] == flight.prefill))
        if not same:  # a fallback placement, or another decode worker than the chosen one
            self._push(FlightEvent(EventKind.ADOPT, RequestId(flight.request_id), time.time(),
                                   state=self._state(flight)))
            assert flight.decode is not None
            self._assigned[flight.request_id] = (flight.prefill, flight.decode)

    def on_stage(self, flight: InFlight, stage: str, t: float) -> None:
        self._push(FlightEvent(EventKind.STAGE, RequestId(flight.request_id), t, stage=stage))

    def on_tokens(self, flight: InFlight, num_tokens: int, t: float) -> None:
        self._events.tokens(flight.request_id, num_tokens, t)

    def on_done(self, flight: InFlight, finished: bool, t: float) -> None:
        rid = RequestId(flight.request_id)
        kind = EventKind.FINISH if finished else EventKind.CANCEL
        self._push(FlightEvent(kind, rid, t, num_output_tokens=len(flight.streamed), spec=flight.spec_totals))
        self._assigned.pop(rid, None)
        self._hashes.pop(rid, None)

    def on_preempted(self, flight: InFlight) -> None:
        self.stats.num_preempted += 1
        self._assigned.pop(flight.request_id, None)
        self._push(FlightEvent(EventKind.ADOPT, RequestId(flight.request_id), time.time(), state=self._state(flight)))

    def _state(self, flight: InFlight) -> FlightState:
        rid = flight.request_id
        return flight_state(flight, self._hashes.get(rid, ()))

    def _push(self, event: FlightEvent) -> None:
        self._events.push(event)
        self.pacer.poke()

    def _readopt(self, rids: Sequence[RequestId]) -> None:
        flights = {f.request_id: f for f in (self._source.in_flight() if self._source else [])}
        for rid in rids:
            flight = flights.get(rid)
            if flight is not None and (flight.decode is not None or flight.phase == PREEMPTED):
                self._push(FlightEvent(EventKind.ADOPT, rid, time.time(), state=self._state(flight)))

    def _preempt(self, rids: Sequence[RequestId]) -> None:
        """Stops the scheduler's victims that this ingress streams (others belong to other
        ingresses, which hear of them in their acknowledgements)."""
        running = []
        for rid in rids:
            stopped = self._source.preempt(rid) if self._source is not None else None
            if stopped:
                self.stats.num_preempted += 1
                self._assigned.pop(rid, None)  # wherever it runs next is news unless the scheduler says so
            elif stopped is False:
                self.stats.num_not_preempted += 1
                running.append(rid)
        if running:  # tell the scheduler they still run
            self._readopt(running)

    def _resume(self, placements: Sequence[Placement]) -> None:
        """Runs preempted requests where the scheduler placed them again."""
        flights = {f.request_id: f for f in (self._source.in_flight() if self._source else [])}
        for p in placements:
            flight = flights.get(p.request_id)
            if flight is None or self._source is None:
                continue  # finished or cancelled meanwhile (its event tells the scheduler)
            if flight.phase != PREEMPTED:  # never stopped (its submit's answer was lost): it runs where it is
                self._readopt([p.request_id])
                continue
            try:
                resumed = self._source.resume(p.request_id, p)
            except NoWorkers:
                self._readopt([p.request_id])  # still preempted: the scheduler queues it again
                continue
            self._assigned[p.request_id] = (p.prefill_worker, p.decode_worker)
            if resumed:
                self.stats.num_resumed += 1

    # ---- the reporter: heartbeats, events, restarts ------------------------------------------

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _mark_down(self, error: BaseException) -> None:
        if self.available:
            logger.warning("scheduler actor unavailable (%s: %s); placing locally", type(error).__name__, error)
        self._down_until = time.monotonic() + self.cfg.down_backoff_s

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._reporter is None or self._reporter.done():
            if self._loop is not loop:
                self._loop, self._ready = loop, asyncio.Event()
                self.pacer.new_loop()
            self._reporter = asyncio.ensure_future(self._report_loop())

    async def _report_loop(self) -> None:
        me = asyncio.current_task()
        # `cancelling()`: Python 3.11's wait_for can swallow a cancellation that races with its
        # result; the loop must still stop when its event loop shuts down.
        while not self._closed and not (me is not None and me.cancelling()):
            heartbeat = self.pacer.idle  # nothing in flight and nothing poked since the last round
            self.pacer.round_starts()
            try:
                await self.report_once(heartbeat)
            except Exception:  # noqa: BLE001 - the reporter must outlive any one bad round
                logger.exception("scheduler report failed")
            self.pacer.round_ends()
            await self.pacer.pause()

    async def report_once(self, heartbeat: bool = False) -> None:
        """One round: loads, telemetry (when due) and pending events to the actor; a rebuild if
        it asks for one. Heartbeats relay telemetry as busy rounds do until a relay finds nothing
        new, then only every `idle_telemetry_interval_s`."""
        self.telemetry_settled &= heartbeat
        loads = await self._source.loads() if self._source is not None else {}
        now = time.time()
        descs = [worker_load(w, now, self.cfg.block_size) for w in loads.values()]
        telemetry = []
        every_s = self.cfg.idle_telemetry_interval_s if self.telemetry_settled else self.cfg.telemetry_interval_s
        if self._source is not None and time.monotonic() >= self._telemetry_at + every_s:
            self._telemetry_at = time.monotonic()
            got = await self._source.telemetry({name: self._cursors.get(name) for name in loads})
            telemetry = [worker_telemetry(t) for t in got.values()]
            if self._pool_holdings is not None:
                try:
                    stores = await asyncio.to_thread(self._pool_holdings, pool_cursors(self._cursors))
                    telemetry += [pool_telemetry(store_id, read) for store_id, read in stores.items()]
                except Exception as e:  # noqa: BLE001 - the pool's index is an estimate: skip a round
                    logger.debug("no prefix-pool holdings this round: %r", e)
            self.telemetry_settled = heartbeat and not any(
                t.steps or t.cache_changes or t.cached_full is not None for t in telemetry)
        events = self._events.take()
        if events:
            self._pending.append((next(self._seq), events))
        if len(self._pending) > self.cfg.max_pending_batches:
            drop = len(self._pending) - self.cfg.max_pending_batches
            self.stats.num_dropped_batches += drop
            del self._pending[:drop]
        try:
            ack = await asyncio.wait_for(
                self.actor.report.remote(self.cfg.client_id, list(self._pending), descs, telemetry,
                                         self._notices_seen),
                self.cfg.call_timeout_s)
        except (RayError, asyncio.TimeoutError) as e:
            self.stats.num_report_failures += 1
            self._mark_down(e)
            return
        self.stats.num_reports += 1
        self.pacer.idle = self._nothing_to_tell(ack)
        self.stats.num_telemetry += len(telemetry)
        self._cursors = {name: telemetry_cursor(c) for name, c in ack.cursors.items()}
        self._pending = [(s, b) for s, b in self._pending if s > ack.applied_seq]
        if ack.incarnation != self.stats.incarnation:
            if self.stats.incarnation is not None:
                self.stats.num_restarts_seen += 1
                logger.warning("scheduler actor restarted (%s -> %s)", self.stats.incarnation, ack.incarnation)
            self.stats.incarnation = ack.incarnation
        if ack.expired:
            logger.warning("scheduler expired queued requests %s", list(ack.expired))
        if ack.notice_seq:
            self._notices_seen = (ack.incarnation, ack.notice_seq)
            if ack.preempt:
                self._preempt(ack.preempt)
            if ack.resume:
                self._resume(ack.resume)
        if ack.needs_rebuild:
            # Everything not applied is superseded by the states taken now, in the same step.
            self._pending.clear()
            self._events.take()
            # Requests still being admitted are left out: their submit journals them.
            flights = [f for f in (self._source.in_flight() if self._source is not None else [])
                       if f.decode or f.phase == PREEMPTED]
            states = [self._state(f) for f in flights]
            self._assigned = {f.request_id: (f.prefill, f.decode) for f in flights if f.decode is not None}
            try:
                await asyncio.wait_for(self.actor.rebuild.remote(self.cfg.client_id, states, descs),
                                       self.cfg.call_timeout_s)
            except (RayError, asyncio.TimeoutError) as e:
                self._mark_down(e)
                return
            self.stats.num_rebuilds += 1
            self.stats.num_rebuilt_requests = len(states)
        self._down_until = 0.0
        self._ready.set()

    def _nothing_to_tell(self, ack: ReportAck) -> bool:
        """After an acknowledged round: no request in flight here or queued at the scheduler (whose
        polls expire and resume them), no notice, nothing unsent or unacknowledged."""
        in_flight = self._source.in_flight() if self._source is not None else []
        return not (in_flight or self._events or self._pending or ack.num_in_flight or ack.notice_seq
                    or ack.needs_rebuild or ack.expired)

    def close(self) -> None:
        self._closed = True
        reporter = self._reporter
        if reporter is not None and not reporter.done() and not reporter.get_loop().is_closed():
            reporter.get_loop().call_soon_threadsafe(reporter.cancel)
