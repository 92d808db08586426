"""The caller that runs one request across the disaggregated workers (the ingress, tests, bench).

Mental model, one `generate(req)`:
  loads (polled, cached for `load_ttl_s`, plus this client's own in-flight counts; workers seen
    dead are reported unhealthy) -> placement (a replaceable policy, or a `ScheduledPlacement`
    that asks the cluster scheduler) -> announce on the first decode worker that has room
    -> open the decode worker's token stream (a Ray streaming generator) -> prefill, which sends
       the KV straight to that decode worker -> yield `TokenEvent`s until the last one.
Every remote call is bounded (`asyncio.wait_for` on the awaited ref) and a miss becomes
`WorkerTimeout`; no room anywhere is `NoCapacity`. If anything fails, or the consumer stops early,
the decode worker is told to abort, which frees the request's blocks whatever state it is in.
Requests with nothing to hand over (1-token prompts, resumes) run on a decode worker alone.

Recovery (`actors/recovery.py`): each request's streamed tokens are journaled in an `InFlight`.
When an attempt fails the way a dead worker fails, the suspects are probed, the dead ones are
excluded from placement for good, and the request waits for its turn in a recovery round (most
urgent first), then resumes on healthy workers from the tokens already streamed. The consumer
sees one uninterrupted stream.

Preemption (`preempt`, `resume`: the scheduler's orders, carried out by `actors/preemption.py`):
a decoding batch request gives its decode row to more urgent work and resumes later from its
tokens, like a recovery; the client sees one stream with a pause.

Room (`actors/room.py`): a new request whose decode workers all refuse its announce for lack of rows
waits in the room queue (interactive first) for up to `ClientConfig.room_wait_s` instead of failing
at once; an interactive one that finds no row also stops this client's cheapest batch row there
(`Preemptions.make_room`) when the scheduler allows preemption.

Replacement: with a `replacer` (the deployment, `PDDeployment.replace`), every worker declared
dead is replaced by a fresh actor of the same name, in the background, retried with backoff up to
`RecoveryConfig.replace_attempts` times; the new handle takes the old one's place and the name
leaves `dead`. A recovery that finds no healthy worker while a replacement is under way waits for
it (up to `RecoveryConfig.replace_wait_s`) instead of failing: a lone decode worker that dies
costs its streams a stall, not an error.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, RayActorError

from actors.errors import NoCapacity, WorkerTimeout
from actors.messages import GenerationRequest, PrefillResult, Telemetry, TelemetryCursor, TokenEvent, WorkerLoad
from actors.placement import (LeastLoaded, NoWorkers, Placement, PlacementChoice, PlacementRefused,
                              ScheduledPlacement)
from actors.recovery import (DECODING, PREEMPTED, PREFILLING, InFlight, RecoveryConfig, RecoveryCoordinator,
                             StreamBroken, is_worker_failure)
from actors.preemption import Preemptions
from actors.room import RoomQueue
from actors.worker_config import ClientConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")
_RECENT = 4096  # prefill results kept for inspection
_SETTLE_S = 3.0  # after a replacement, how long "no healthy worker" may still be the scheduler's stale view
NO_HEALTHY_WORKER = "no_healthy_worker"  # the scheduler's refusal reason (cluster.admission.RefusalReason)


class Replacer(Protocol):
    async def replace(self, name: str) -> ActorHandle:
        """A fresh, wired, answering actor for the dead worker `name` (raises if it cannot start)."""
        ...

_Outcome = PlacementChoice | BaseException


_BACKGROUND: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks


def _discard(stream: Any, timeout_s: float = 120.0) -> None:
    """Reads an abandoned stream to its end in the background, so its refs (failed with the
    abort) are consumed instead of logged by Ray as unhandled errors."""
    async def drain() -> None:
        try:
            async with asyncio.timeout(timeout_s):
                async for ref in stream:
                    with contextlib.suppress(Exception):
                        await ref
        except Exception:  # noqa: BLE001 - the stream's end is all that matters
            pass

    task = asyncio.ensure_future(drain())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


class PDClient:
    def __init__(self, prefills: Mapping[str, ActorHandle], decodes: Mapping[str, ActorHandle],
                 cfg: ClientConfig | None = None, placement: Placement | ScheduledPlacement | None = None,
                 recovery: RecoveryConfig | None = None, replacer: Replacer | None = None) -> None:
        """`decodes` are keyed by the name the prefill workers know their endpoints by."""
        self.prefills = dict(prefills)
        self.decodes = dict(decodes)
        self.cfg = cfg or ClientConfig()
        self.placement = placement or LeastLoaded()
        self.scheduled = placement if isinstance(placement, ScheduledPlacement) else None
        self.local_placement: Placement = LeastLoaded() if self.scheduled is not None else self.placement  # type: ignore[assignment]
        self.recovery_cfg = recovery or RecoveryConfig()
        self.flights: dict[str, InFlight] = {}
        self.dead: set[str] = set()  # workers seen dead (their actors do not restart) and not yet replaced
        self.replacer = replacer
        self.replacing: dict[str, asyncio.Task[None]] = {}
        self.num_replaced = 0
        self.preemptions = Preemptions(self)
        self.room = RoomQueue()  # new requests waiting for a decode row, most urgent first
        self.replaced_at = float("-inf")  # time.monotonic() of the last replacement
        self.recoveries = RecoveryCoordinator(self._plan_recovery, self.in_flight, self.recovery_cfg)
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._loads: dict[str, WorkerLoad] = {}
        self._loads_at = float("-inf")
        self._refresh: asyncio.Task[None] | None = None
        self._results: collections.OrderedDict[str, PrefillResult] = collections.OrderedDict()
        if self.scheduled is not None:
            self.scheduled.attach(self)

    def in_flight(self) -> list[InFlight]:
        return list(self.flights.values())

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if req.request_id in self.flights:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        flight = self.flights[req.request_id] = InFlight(req)
        finished = False
        try:
            choice = await self._admit(req)
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
            if self.scheduled is not None:
                self.scheduled.on_done(flight, finished, time.time())

    async def _admit(self, req: GenerationRequest) -> PlacementChoice:
        loads = await self.loads()
        prefills, decodes = [loads[n] for n in self.prefills], [loads[n] for n in self.decodes]
        if self.scheduled is not None:
            return await self.scheduled.admit(req, prefills, decodes)
        return self.local_placement.place(req, prefills, decodes)

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
        dead = await self._diagnose(flight, error)
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
            except (NoWorkers, PlacementRefused) as e:
                if isinstance(e, PlacementRefused) and e.reason != NO_HEALTHY_WORKER:
                    raise
                now = time.monotonic()
                settling = now - self.replaced_at < _SETTLE_S
                if not (self.replacing or settling) or now >= deadline:
                    raise
                if self.replacing:
                    logger.info("%s: no healthy worker for it; waiting for the replacement of %s",
                                flight.request_id, ", ".join(sorted(self.replacing)))
                    await asyncio.wait(list(self.replacing.values()), timeout=deadline - now)
                else:
                    await asyncio.sleep(min(0.25, deadline - now))
                dead = frozenset()  # a retry: the dead workers' round has been planned

    def preempt(self, request_id: str) -> bool | None:
        """Stops `request_id`'s decode row now, its stream kept open (`Preemptions.stop`)."""
        return self.preemptions.stop(request_id)

    def resume(self, request_id: str, choice: PlacementChoice) -> bool:
        """Where a preempted request runs next (`Preemptions.resume`)."""
        return self.preemptions.resume(request_id, choice)

    async def _attempt(self, flight: InFlight, choice: PlacementChoice) -> AsyncIterator[TokenEvent]:
        """One try at running `flight` where `choice` says; events are journaled as they pass."""
        req = flight.attempt_request()
        rid = req.request_id
        if choice.priority is not None and choice.priority[0] != req.priority_rank:
            req = replace(req, priority_rank=choice.priority[0])  # engines queue batch work behind
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
        sched = self.scheduled
        if sched is not None:
            sched.on_placed(flight)
        self._in_flight[decode] += 1
        try:
            if not handoff:
                stream = self.decodes[decode].generate.options(num_returns="streaming").remote(req)
                flight.mark_issued()
                if sched is not None:
                    sched.on_stage(flight, "decode_admitted", time.time())
            else:
                stream = self.decodes[decode].generate_after_kv.options(num_returns="streaming").remote(rid)
                assert choice.prefill is not None
                pending = self.prefills[choice.prefill].prefill.remote(req, decode)
                if sched is not None:
                    sched.on_stage(flight, "prefill_start", time.time())
                try:
                    result = await self._bounded(pending, self.cfg.prefill_timeout_s, f"prefill of {rid}")
                except BaseException:
                    self.decodes[decode].abort.remote(rid)  # frees the reservation at once
                    _discard(stream)
                    raise
                self._remember(replace(result, request_id=flight.request_id))
                flight.phase = DECODING
                if sched is not None:
                    sched.on_stage(flight, "kv_transfer_done", time.time())
            async with contextlib.aclosing(self._follow(decode, rid, stream)) as events:
                async for raw in events:
                    if flight.phase == PREEMPTED:  # the abort may have raced the stream's start
                        raise StreamBroken(f"{rid} was preempted")
                    event = flight.on_event(raw)
                    if event is None:  # a token sampled again whose text is not complete yet
                        continue
                    if sched is not None and event.output.new_token_ids:
                        sched.on_tokens(flight, len(event.output.new_token_ids), event.emitted_at)
                    yield event
        finally:
            self._in_flight[decode] -= 1
            self.room.release()

    async def _diagnose(self, flight: InFlight, error: BaseException) -> frozenset[str]:
        """Which of the failed attempt's workers are dead: probed with a short deadline (a dead
        actor answers at once with `ActorDiedError`; an engine whose loop died reports itself
        unhealthy). Dead workers are excluded from placement from now on."""
        suspects = [w for w in (flight.decode, flight.prefill if flight.phase != DECODING else None) if w]
        if isinstance(error, NoCapacity):
            suspects = []

        async def probe(name: str) -> bool:
            if name in self.dead:
                return True
            handle = self.prefills.get(name) or self.decodes[name]
            try:
                load = await self._bounded(handle.load.remote(), self.recovery_cfg.probe_timeout_s, f"probe of {name}")
            except ActorDiedError:
                return self._mark_dead(name)
            except (RayActorError, WorkerTimeout) as e:  # restarting or slow: not known dead
                logger.warning("probe of %s failed: %s", name, e)
                return False
            return False if load.healthy else self._mark_dead(name)

        found = await asyncio.gather(*(probe(n) for n in suspects))
        return frozenset(n for n, is_dead in zip(suspects, found) if is_dead)

    def _mark_dead(self, name: str) -> bool:
        if name not in self.dead:
            logger.warning("worker %s is dead; excluded from placement%s", name,
                           "; starting a replacement" if self.replacer is not None else "")
            self.dead.add(name)
            if self.replacer is not None and name not in self.replacing:
                self.replacing[name] = asyncio.ensure_future(self._replace(name))
        load = self._loads.get(name)
        if load is not None:
            self._loads[name] = replace(load, healthy=False)
        return True

    async def _replace(self, name: str) -> None:
        """Asks the replacer for a fresh `name` until one starts (backoff between tries); then the
        new handle takes the old one's place and the worker is placeable again."""
        assert self.replacer is not None
        cfg = self.recovery_cfg
        try:
            for attempt in range(1, cfg.replace_attempts + 1):
                started = time.monotonic()
                try:
                    handle = await self.replacer.replace(name)
                except Exception as e:  # noqa: BLE001 - logged; tried again or given up below
                    logger.warning("replacement %d/%d of %s failed: %r", attempt, cfg.replace_attempts, name, e)
                    if attempt < cfg.replace_attempts:
                        await asyncio.sleep(cfg.replace_backoff_s * 2 ** (attempt - 1))
                    continue
                (self.prefills if name in self.prefills else self.decodes)[name] = handle
                self.dead.discard(name)
                self.num_replaced += 1
                self.replaced_at = time.monotonic()
                self._loads_at = float("-inf")  # the next placement sees it healthy
                logger.warning("worker %s replaced in %.1f s; placeable again", name, time.monotonic() - started)
                return
            logger.error("gave up replacing %s after %d tries; it stays out of placement", name, cfg.replace_attempts)
        finally:
            self.replacing.pop(name, None)

    async def _plan_recovery(self, dead: frozenset[str], flights: list[InFlight]) -> list[tuple[InFlight, _Outcome]]:
        loads = await self.loads()
        prefills, decodes = [loads[n] for n in self.prefills], [loads[n] for n in self.decodes]
        if self.scheduled is not None:
            return await self.scheduled.recover(dead, flights, prefills, decodes)
        plan: list[tuple[InFlight, _Outcome]] = []
        for flight in sorted(flights, key=lambda f: (f.req.arrival_time, f.request_id)):
            try:
                plan.append((flight, self.local_placement.place(flight.resume_request(), prefills, decodes)))
            except NoWorkers as e:
                plan.append((flight, e))
        return plan

    async def _announce_queued(self, req: GenerationRequest, choice: PlacementChoice) -> str:
        """`_announce` for a new request: while every decode row is taken it waits in the room
        queue (`actors/room.py`) for up to `room_wait_s`, then is refused (`NoCapacity`)."""
        rank, key = choice.priority or (0, req.arrival_time)
        if self.room.may_skip(rank, key):
            try:
                return await self._announce(req, choice.decodes)
            except NoCapacity:
                if self.cfg.room_wait_s <= 0:
                    raise
        deadline = time.monotonic() + self.cfg.room_wait_s
        ticket = self.room.join(rank, key)
        try:
            while True:
                if rank == 0:
                    self.preemptions.make_room(choice.decodes[0])
                if not await self.room.turn(ticket, deadline - time.monotonic()):
                    break
                try:
                    return await self._announce(req, choice.decodes)
                except NoCapacity:
                    pass
            raise NoCapacity(f"no decode worker had room for {req.request_id} within {self.cfg.room_wait_s:g}s")
        finally:
            self.room.leave(ticket)

    async def _announce(self, req: GenerationRequest, decodes: tuple[str, ...]) -> str:
        for name in decodes:
            await self.preemptions.wait_freed(name, self.cfg.call_timeout_s)
            try:
                if await self._bounded(self.decodes[name].announce.remote(req), self.cfg.call_timeout_s,
                                       f"announce of {req.request_id} on {name}"):
                    return name
            except (WorkerTimeout, RayActorError) as e:
                logger.warning("decode worker %s did not take %s: %s", name, req.request_id, e)
                if isinstance(e, ActorDiedError):
                    self._mark_dead(name)
                else:
                    self.decodes[name].abort.remote(req.request_id)  # in case it reserved after all
        raise NoCapacity(f"no decode worker has room for {req.request_id} now (asked {len(decodes)})")

    async def _follow(self, decode: str, request_id: str, stream: Any) -> AsyncIterator[TokenEvent]:
        """Yields the stream's events, each within `token_timeout_s`; aborts unless it finished."""
        finished = False
        try:
            while not finished:
                try:
                    ref = await asyncio.wait_for(stream.__anext__(), self.cfg.token_timeout_s)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise WorkerTimeout(f"{decode} sent nothing for {request_id} "
                                        f"in {self.cfg.token_timeout_s:g}s") from None
                event: TokenEvent = await ref
                finished = event.output.finished
                yield event
        finally:
            if not finished:
                self.decodes[decode].abort.remote(request_id)
                _discard(stream)  # its last ref carries the abort's error: consumed, not logged

    async def _bounded(self, ref: Awaitable[T], timeout_s: float, what: str) -> T:
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except asyncio.TimeoutError:
            raise WorkerTimeout(f"{what} did not answer within {timeout_s:g}s") from None

    # --------------------------------------------------------------------------------- loads
    async def loads(self) -> dict[str, WorkerLoad]:
        """Every worker's load, at most `load_ttl_s` old, with this client's in-flight requests
        counted in (a burst is placed before any worker reports it); dead workers unhealthy."""
        if time.monotonic() - self._loads_at > self.cfg.load_ttl_s:
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.ensure_future(self._poll())
            await asyncio.shield(self._refresh)
        out = {}
        for name, load in self._loads.items():
            if name in self.dead and load.healthy:
                load = replace(load, healthy=False)
            extra = self._in_flight[name] - load.num_active
            out[name] = replace(load, num_waiting=load.num_waiting + extra) if extra > 0 else load
        return out

    async def _poll(self) -> None:
        workers = {**self.prefills, **self.decodes}

        async def one(name: str, handle: ActorHandle) -> WorkerLoad:
            kind = "prefill" if name in self.prefills else "decode"
            if name in self.dead:  # dead actors stay dead: no call, no warning every poll
                return WorkerLoad(name, kind, 0, 0, 0, 0, 0, 0.0, healthy=False)
            try:
                load = await self._bounded(handle.load.remote(), self.cfg.call_timeout_s, f"load of {name}")
                if not load.healthy:  # its engine loop died: it never steps again
                    self._mark_dead(name)
                return replace(load, name=name)  # our key is the name placement answers with
            except (WorkerTimeout, RayActorError) as e:
                if isinstance(e, ActorDiedError):
                    self._mark_dead(name)
                elif name not in self.dead:
                    logger.warning("worker %s is unhealthy: %s", name, e)
                return WorkerLoad(name, kind, 0, 0, 0, 0, 0, 0.0, healthy=False)

        loads = await asyncio.gather(*(one(n, h) for n, h in workers.items()))
        self._loads = {w.name: w for w in loads}
        self._loads_at = time.monotonic()

    async def telemetry(self, cursors: Mapping[str, TelemetryCursor | None]) -> dict[str, Telemetry]:
        """Each live worker's engine telemetry after its cursor (see `actors/telemetry.py`), for the
        scheduler's cost models and prefix index; a worker that does not answer in time is left out."""
        workers = {**self.prefills, **self.decodes}

        async def one(name: str, handle: ActorHandle) -> Telemetry | None:
            try:
                return await self._bounded(handle.telemetry.remote(cursors.get(name)), self.cfg.call_timeout_s,
                                           f"telemetry of {name}")
            except (WorkerTimeout, RayActorError) as e:
                logger.debug("no telemetry from %s: %s", name, e)
                return None

        names = [n for n in workers if n not in self.dead]
        got = await asyncio.gather(*(one(n, workers[n]) for n in names))
        return {n: t for n, t in zip(names, got) if t is not None}

    def _remember(self, result: PrefillResult) -> None:
        self._results[result.request_id] = result
        while len(self._results) > _RECENT:
            self._results.popitem(last=False)

    def prefill_result(self, request_id: str) -> PrefillResult | None:
        """How a recent request was prefilled (reuse, bytes, stage times)."""
        return self._results.get(request_id)
