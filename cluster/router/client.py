"""The router: runs one request across the disaggregated workers (the ingress, tests, bench).

Mental model, one `generate(req)`:
  loads (`LoadBoard`: polled, cached for `load_ttl_s`, plus this router's own in-flight counts)
    -> one placement decision (`_place`: the control plane's when it answers, else the local
       policy's; the policy orders the rest of the workers either way) -> announce on the first
       decode worker that has room -> open that worker's token stream -> prefill, which sends the
       KV straight to it -> yield `TokenEvent`s until the last one.
Every call to a worker goes through its `WorkerHandle` and is bounded (a miss becomes
`WorkerTimeout`); no room anywhere is `NoCapacity`. If anything fails, or the consumer stops early,
the decode worker is told to abort, which frees the request's blocks whatever state it is in.
Requests with nothing to hand over (1-token prompts, resumes, colocated workers) run on a decode
worker alone.

Recovery (`flight.py`, `rounds.py`): each request's streamed tokens are journaled in an
`InFlight`. When an attempt fails the way a dead worker fails, the suspects are probed, the dead
ones leave placement (and are replaced when a `Replacer` is given: `replacement.py`), and the
request waits for its turn in a recovery round, then resumes on healthy workers from the tokens
already streamed, and from its KV shadows (`shadow_salt`, drawn here) when the pool has them; with
no decode worker up, on a prefill worker meanwhile (`_borrow`). The consumer sees one stream.

Preemption (`preempt`, `resume`: the scheduler's orders, carried out by `preemption.py`) and
waiting for a decode row (`room.py`) are the router's too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace

from actors.errors import NoCapacity, NoWorkers, Refused, WorkerTimeout
from actors.messages import GenerationRequest, PrefillResult, Telemetry, TelemetryCursor, TokenEvent, WorkerLoad
from cluster.placement import Placement
from cluster.router.choice import LeastLoaded, LocalPolicy, PlacementChoice, lend_prefill
from cluster.router.config import RecoveryConfig, RouterConfig
from cluster.router.follow import follow
from cluster.router.control import ControlPlane
from cluster.router.flight import DECODING, PREEMPTED, PREFILLING, InFlight, StreamBroken, is_worker_failure
from cluster.router.handles import TokenStream, WorkerGone, WorkerHandle, WorkerUnreachable, start_prefetch
from cluster.router.loads import LoadBoard, bounded
from cluster.router.preemption import Preemptions
from cluster.router.replacement import Replacements, Replacer
from cluster.router.room import Patience, RoomQueue
from cluster.router.rounds import Outcome, RecoveryCoordinator

logger = logging.getLogger(__name__)
_RECENT = 4096  # prefill results kept for inspection
_SETTLE_S = 3.0  # after a replacement or a join, how long "no healthy worker" may be the scheduler's stale view
NO_HEALTHY_WORKER = "no_healthy_worker"  # the scheduler's refusal reason (cluster.admission.RefusalReason)


class Router:
    def __init__(self, prefills: Mapping[str, WorkerHandle], decodes: Mapping[str, WorkerHandle],
                 cfg: RouterConfig | None = None, *, policy: LocalPolicy | None = None,
                 control: ControlPlane | None = None, recovery: RecoveryConfig | None = None,
                 replacer: Replacer | None = None) -> None:
        """`decodes` are keyed by the name the prefill workers know their endpoints by. `policy`
        places when no control plane decides (default `LeastLoaded`)."""
        self.prefills = dict(prefills)
        self.decodes = dict(decodes)
        self.cfg = cfg or RouterConfig()
        self.policy: LocalPolicy = policy or LeastLoaded()
        self.control = control
        self.recovery_cfg = recovery or RecoveryConfig()
        self.flights: dict[str, InFlight] = {}
        self.board = LoadBoard(self.prefills, self.decodes, self.cfg)
        self.replacements = None if replacer is None else Replacements(
            replacer, self.board, {"prefill": self.prefills, "decode": self.decodes}, self.recovery_cfg)
        if self.replacements is not None:
            self.board.on_dead = self.replacements.start
        self.room = RoomQueue()  # new requests waiting for a decode row, most urgent first
        # Whether decode capacity is being added (set by the ingress under Serve): waiters wait for it.
        self.capacity_coming: Callable[[], bool] = lambda: False
        self.preemptions = Preemptions(self.flights, self.decodes, self.room, control, self._place_locally,
                                       self.recovery_cfg.resume_wait_s)
        self.recoveries = RecoveryCoordinator(self._plan_recovery, self.in_flight, self.recovery_cfg)
        self._results: collections.OrderedDict[str, PrefillResult] = collections.OrderedDict()
        if control is not None:
            control.attach(self)

    # ---- what the control plane may ask (`FlightSource`) ---------------------------------------

    def in_flight(self) -> list[InFlight]:
        return list(self.flights.values())

    async def loads(self) -> dict[str, WorkerLoad]:
        return await self.board.loads()

    async def telemetry(self, cursors: Mapping[str, TelemetryCursor | None]) -> dict[str, Telemetry]:
        return await self.board.telemetry(cursors)

    def preempt(self, request_id: str) -> bool | None:
        """Stops `request_id`'s decode row now, its stream kept open (`Preemptions.stop`)."""
        return self.preemptions.stop(request_id)

    def resume(self, request_id: str, decided: Placement) -> bool:
        """Runs a preempted request where the control plane placed it again (`Preemptions.resume`)."""
        flight = self.flights.get(request_id)
        if flight is None:
            return False
        return self.preemptions.resume(request_id, self._choose(flight.resume_request(), self.board.cached(), decided))

    def add_worker(self, kind: str, handle: WorkerHandle) -> None:
        """A worker that joined (a new Serve replica, already wired): placeable from the next poll."""
        (self.prefills if kind == "prefill" else self.decodes)[handle.name] = handle
        self.board.revive(handle.name)

    def prefill_result(self, request_id: str) -> PrefillResult | None:
        """How a recent request was prefilled (reuse, bytes, stage times)."""
        return self._results.get(request_id)

    # ---- placement: one decision per attempt ---------------------------------------------------

    def _choose(self, req: GenerationRequest, loads: Mapping[str, WorkerLoad],
                decided: Placement | None = None) -> PlacementChoice:
        prefills, decodes = self.board.split(loads)
        return self.policy.place(req, prefills, decodes, decided=decided)

    async def _place(self, req: GenerationRequest) -> PlacementChoice:
        """A new request's placement: the control plane's decision, or the local policy's when it
        is away (then queued by arrival, in its SLO class). A request that comes before any worker
        is known (Serve replicas still starting) waits for them, as long as a replacement would."""
        await self.board.wait_for_workers(self.recovery_cfg.replace_wait_s)
        loads = await self.board.loads()
        if self.control is None:
            return self._choose(req, loads)
        settle_until = time.monotonic() + _SETTLE_S
        while True:
            try:
                decided = await self.control.admit(req)
                break
            except Refused as e:
                # A stale "none" (workers that just joined); past _SETTLE_S this router's view is the fresher.
                if e.reason != NO_HEALTHY_WORKER or not self._serves(loads):
                    raise
                if time.monotonic() >= settle_until:
                    logger.warning("%s: the scheduler still sees no healthy worker; placed here", req.request_id)
                    decided = None
                    break
                await asyncio.sleep(0.2)
                loads = await self.board.loads()
        choice = self._choose(req, loads, decided)
        local = replace(choice, priority=(self.control.fallback_rank(req), req.arrival_time))
        return choice if decided is not None else local

    def _serves(self, loads: Mapping[str, WorkerLoad]) -> bool:
        """Whether this router sees a healthy worker of every kind a request needs."""
        prefills, decodes = self.board.split(loads)
        return any(w.healthy for w in decodes) and (not prefills or any(w.healthy for w in prefills))

    async def _place_locally(self, flight: InFlight) -> PlacementChoice:
        return self._choose(flight.resume_request(), await self.board.loads())

    async def _plan_recovery(self, dead: frozenset[str], flights: list[InFlight]) -> list[tuple[InFlight, Outcome]]:
        if self.control is not None:
            planned = await self.control.recover(dead, flights)
        else:
            planned = [(f, None) for f in sorted(flights, key=lambda f: (f.req.arrival_time, f.request_id))]
        loads = await self.board.loads()
        plan: list[tuple[InFlight, Outcome]] = []
        for flight, decided in planned:
            if isinstance(decided, BaseException):
                plan.append((flight, decided))
                continue
            try:
                plan.append((flight, self._choose(flight.resume_request(), loads, decided)))
            except NoWorkers as e:
                plan.append((flight, e))
        return plan

    # ---- one request ---------------------------------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if req.request_id in self.flights:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        flight = self.flights[req.request_id] = InFlight(req)
        finished = False
        try:
            choice = await self._place(req)
            while True:
                try:
                    # aclosing: a consumer that stops early closes the attempt now, which aborts it
                    async with contextlib.aclosing(self._attempt(flight, choice)) as events:
                        async for event in events:
                            finished = event.output.finished
                            yield event
                    if not finished:
                        raise StreamBroken(f"{flight.decode} ended the stream of {req.request_id} early")
                    return
                except Exception as e:
                    if flight.phase == PREEMPTED:  # the row was taken on purpose: wait for a new one
                        choice = await self.preemptions.wait_resumed(flight)
                        flight.next_attempt()
                        continue
                    if not is_worker_failure(e, flight.attempt):
                        raise
                    dead = await self._after_failure(flight, e)
                    choice = await self._recover(flight, dead)
                    flight.next_attempt()
        finally:
            del self.flights[req.request_id]
            if self.control is not None:
                self.control.on_done(flight, finished, time.time())

    async def _attempt(self, flight: InFlight, choice: PlacementChoice) -> AsyncIterator[TokenEvent]:
        """One try at running `flight` where `choice` says; events are journaled as they pass."""
        req = flight.attempt_request()
        rid = req.request_id
        req = choice.apply(req)  # its class rank (engines queue batch work behind) and TPOT target
        flight.priority_rank = req.priority_rank
        handoff = choice.prefill is not None and req.needs_handoff
        if handoff:
            flight.mark_issued()  # the announce below is this attempt's first call to a worker
            if flight.attempt == 0:
                decode = await self._announce_queued(req, choice)
            else:  # a recovery without room waits in `_after_failure`
                decode = await self._announce(req, choice.decodes)
        else:
            decode = choice.decodes[0]
            if choice.local_chunk_tokens is not None:  # a local prefill: keep its steps within TPOT
                req = replace(req, max_chunk_tokens=choice.local_chunk_tokens)
        flight.place(choice.prefill if handoff else None, decode, PREFILLING if handoff else DECODING)
        control = self.control
        if control is not None:
            control.on_placed(flight)
        self.board.in_flight[decode] += 1
        try:
            worker = self.board.handle(decode)  # a decode worker, or a prefill worker lent by `_borrow`
            if not handoff:
                stream = worker.stream(req)
                flight.mark_issued()
                if control is not None:
                    control.on_stage(flight, "decode_admitted", time.time())
            else:
                stream = worker.stream_after_kv(rid)
                assert choice.prefill is not None
                pending = self.prefills[choice.prefill].prefill(req, decode)
                if control is not None:
                    control.on_stage(flight, "prefill_start", time.time())
                try:
                    result = await bounded(pending, self.cfg.prefill_timeout_s, f"prefill of {rid}")
                except BaseException:
                    worker.abort(rid)  # frees the reservation at once
                    stream.discard()
                    raise
                self._results[flight.request_id] = replace(result, request_id=flight.request_id)
                while len(self._results) > _RECENT:
                    self._results.popitem(last=False)
                flight.phase = DECODING
                if control is not None:
                    control.on_stage(flight, "kv_transfer_done", time.time())
            async with contextlib.aclosing(self._follow(worker, rid, stream)) as events:
                async for raw in events:
                    if flight.phase == PREEMPTED:  # the abort may have raced the stream's start
                        raise StreamBroken(f"{rid} was preempted")
                    event = flight.on_event(raw)
                    if event is None:  # a token sampled again whose text is not complete yet
                        continue
                    if control is not None and event.output.new_token_ids:
                        control.on_tokens(flight, len(event.output.new_token_ids), event.emitted_at)
                    self.room.streamed()
                    yield event
        finally:
            self.board.in_flight[decode] -= 1
            self.room.release()

    def _follow(self, worker: WorkerHandle, request_id: str, stream: TokenStream) -> AsyncIterator[TokenEvent]:
        return follow(worker, request_id, stream, token_timeout_s=self.cfg.token_timeout_s,
                      row_wait_s=self.cfg.row_wait_s, probe_timeout_s=self.recovery_cfg.probe_timeout_s)

    # ---- a decode row --------------------------------------------------------------------------

    async def _announce_queued(self, req: GenerationRequest, choice: PlacementChoice) -> str:
        """`_announce` for a new request: while every decode row is taken it waits in the room queue
        and is refused (`NoCapacity`) once its `Patience` runs out (`room.py`). What the SLOs cannot
        wait for, the scheduler's admission refuses up front (`slo_unattainable`)."""
        rank, key = choice.priority or (0, req.arrival_time)
        if self.room.may_skip(rank, key):
            try:
                return await self._announce(req, choice.decodes)
            except NoCapacity:
                if self.cfg.room_wait_s <= 0:
                    raise
        start_prefetch(self.prefills, choice.prefill, req)  # it waits: its prefix comes up from disk meanwhile
        patience = Patience(self.room, lambda: self.decodes, self.capacity_coming, self.cfg.room_wait_s,
                            self.cfg.room_max_wait_s, self.board.decode_rows_stepped)
        ticket = self.room.join(rank, key)
        try:
            while (left := patience.left_s()) > 0 or await self._rows_moved(patience):
                if rank == 0:
                    self.preemptions.make_room(choice.decodes[0])
                if not await self.room.turn(ticket, max(left, self.room.poll_s)):
                    continue  # not its turn yet: `patience` says whether it keeps its place
                try:
                    return await self._announce(req, choice.decodes + tuple(n for n in self.decodes
                                                                            if n not in choice.decodes))
                except NoCapacity:
                    pass
            raise NoCapacity(f"no decode worker had room for {req.request_id}: {patience.why_over()}")
        finally:
            self.room.leave(ticket)

    async def _rows_moved(self, patience: Patience) -> bool:
        """At the end of a wait: whether the decode workers stepped rows since (other callers' rows
        free too), from a fresh poll of their loads."""
        await self.board.loads()
        return patience.left_s() > 0

    async def _announce(self, req: GenerationRequest, decodes: tuple[str, ...]) -> str:
        for name in decodes:
            await self.preemptions.wait_freed(name, self.cfg.call_timeout_s)
            worker = self.decodes[name]
            try:
                if await bounded(worker.announce(req), self.cfg.call_timeout_s,
                                 f"announce of {req.request_id} on {name}"):
                    return name
            except (WorkerTimeout, WorkerUnreachable) as e:
                logger.warning("decode worker %s did not take %s: %s", name, req.request_id, e)
                if isinstance(e, WorkerGone):
                    self.board.mark_dead(name)
                else:
                    worker.abort(req.request_id)  # in case it reserved after all
        raise NoCapacity(f"no decode worker has room for {req.request_id} now (asked {len(decodes)})")

    # ---- after a failure -----------------------------------------------------------------------

    async def _after_failure(self, flight: InFlight, error: Exception) -> frozenset[str]:
        """Decides whether a failed attempt is tried again (else re-raises `error`) and which
        workers died. A recovery that found no room waits for some (with backoff, up to
        `room_wait_s` in all); a worker failure counts against `max_recoveries`."""
        cfg, rid = self.recovery_cfg, flight.request_id
        if isinstance(error, NoCapacity):
            now = time.monotonic()
            if flight.room_deadline is None:
                flight.room_deadline = now + cfg.room_wait_s
            if now >= flight.room_deadline:
                raise error
            flight.num_room_waits += 1
            await asyncio.sleep(min(2.0, cfg.retry_delay_s * 2 ** min(flight.num_room_waits, 8)))
            return frozenset()
        flight.num_failures += 1
        if flight.num_failures > cfg.max_recoveries:
            raise error
        suspects = [w for w in (flight.decode, flight.prefill if flight.phase != DECODING else None) if w]
        found = await asyncio.gather(*(self.board.is_dead(n, cfg.probe_timeout_s) for n in suspects))
        dead = frozenset(n for n, is_dead in zip(suspects, found) if is_dead)
        logger.warning("%s: attempt %d on %s/%s failed (%s: %s); dead: %s; resuming after %d tokens", rid,
                       flight.attempt, flight.prefill, flight.decode, type(error).__name__, error,
                       sorted(dead) or "none", len(flight.streamed))
        if not dead:
            await asyncio.sleep(cfg.retry_delay_s)
        return dead

    async def _recover(self, flight: InFlight, dead: frozenset[str]) -> PlacementChoice:
        """Where `flight` resumes (`RecoveryCoordinator.recover`). When no worker can take it while
        replacements are starting (or one just joined and the scheduler may not have heard yet),
        waits for them and asks again, until `replace_wait_s` has passed."""
        deadline = time.monotonic() + self.recovery_cfg.replace_wait_s
        while True:
            try:
                return await self.recoveries.recover(flight, dead)
            except Refused as e:
                if not (isinstance(e, NoWorkers) or e.reason == NO_HEALTHY_WORKER):
                    raise
                if (lent := await self._borrow(flight)) is not None:
                    return self.recoveries.lent(flight, dead, lent)
                reps = self.replacements
                now = time.monotonic()
                if reps is None or not (reps.replacing or now - reps.replaced_at < _SETTLE_S) or now >= deadline:
                    raise
                if reps.replacing:
                    logger.info("%s: no healthy worker for it; waiting for the replacement of %s",
                                flight.request_id, ", ".join(sorted(reps.replacing)))
                    await reps.wait(deadline - now)
                else:
                    await asyncio.sleep(min(0.25, deadline - now))
                dead = frozenset()  # a retry: the dead workers' round has been planned

    async def _borrow(self, flight: InFlight) -> PlacementChoice | None:
        """With no decode worker up (a lone one died, its replacement starting), the request resumes
        on a prefill worker meanwhile (`lend_prefill`), from its KV shadows if any; None: not allowed."""
        if not self.cfg.lend_prefill:
            return None
        choice = lend_prefill(*self.board.split(await self.board.loads()))
        if choice is not None:
            logger.warning("%s: no decode worker is up; resuming on prefill worker %s", flight.request_id, choice.decodes[0])
        return choice
