"""Recovery in the request path: the caller's journal of each stream, and resuming it elsewhere.

Mental model: the caller (`PDClient`) is the one place that sees every token a client received,
so it keeps the journal: per request an `InFlight` with the tokens already streamed, the text
already sent, and where the request runs now. When a worker of the request dies (its actor
fails, its stream breaks, a deadline passes), the request is run again as a new *attempt* on a
healthy worker with `GenerationRequest(output_token_ids=streamed, seed=same)`: the engine
recomputes prompt + streamed tokens and continues the same sampling stream, so the client sees
the next token, never a repeated or a skipped one. Text needs one more step: the last tokens
streamed may not have produced their text yet (a character split across tokens is held back
until it completes), and an engine resuming after them would treat them as already shown. So a
resume starts after the last token whose text went out (`emitted_tokens`); the engine samples the
few after it again (same seed, same positions: the same ids, checked), and their events pass
through carrying only their text. Each attempt runs under its own worker-side id (`<id>~r<n>`),
so a late abort or a stale stream of an earlier attempt cannot touch a later one.

Recoveries are ordered: the requests a dead worker held fail within moments of each other, and
the `RecoveryCoordinator` gathers them into one round (until every in-flight request touching the
dead workers has reported, or `gather_s` passed), asks for a plan (the cluster scheduler's
recovery plan, most urgent remaining SLO budget first, or arrival order without one), and
releases them one at a time: the next is released once the previous one's first call to a worker
was issued. `RecoveryRecord`s log the issue order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from ray.exceptions import RayActorError

from actors.engine.async_engine import EngineDead
from actors.errors import DataPlaneError, HandoffFailed, KVNotArrived, NoCapacity, UnknownRequest, WorkerTimeout
from actors.messages import GenerationRequest, TokenEvent
from actors.placement import PlacementChoice
from transfer.transport import TransferError

logger = logging.getLogger(__name__)

# Phases of an attempt, as the caller sees them. PREEMPTED: its decode row was taken for more
# urgent work; it holds no worker and waits to be placed again (`PDClient.preempt`).
PLACED, PREFILLING, DECODING, PREEMPTED = "placed", "prefilling", "decoding", "preempted"


class StreamBroken(DataPlaneError):
    """A worker's stream ended before its last event."""


class ReplayMismatch(StreamBroken):
    """A resumed stream sampled a token other than the one already streamed at that position."""


# What a dead or sick worker looks like to the caller. Bad input (`InvalidRequest`), refusals
# and aborts are not in it: they would fail again anywhere.
_WORKER_FAILURES: tuple[type[BaseException], ...] = (
    RayActorError, WorkerTimeout, KVNotArrived, HandoffFailed, UnknownRequest, StreamBroken, TransferError,
    EngineDead,
)


def is_worker_failure(exc: BaseException, attempt: int) -> bool:
    """Whether `exc` means "run this request elsewhere". `NoCapacity` counts only for a recovery
    (a new request without room is refused instead)."""
    return isinstance(exc, _WORKER_FAILURES) or (attempt > 0 and isinstance(exc, NoCapacity))


@dataclass(frozen=True)
class RecoveryConfig:
    gather_s: float = 1.0  # how long a round waits for the other victims of the same death
    issue_timeout_s: float = 5.0  # longest a round waits for one recovery to be issued before the next
    probe_timeout_s: float = 3.0  # deadline of the health probe of a suspect worker
    max_recoveries: int = 4  # worker failures per request; past it the failure reaches the caller
    retry_delay_s: float = 0.2  # before re-placing a request whose workers all look alive
    room_wait_s: float = 60.0  # a recovery that finds no decode worker with room retries this long
    resume_wait_s: float = 600.0  # a preempted request waits this long for the scheduler, then is placed here
    replace_wait_s: float = 120.0  # a recovery with no healthy worker waits this long for a replacement
    replace_attempts: int = 3  # tries at starting a dead worker's replacement before giving up
    replace_backoff_s: float = 2.0  # before the second try; doubled for each further one

    def __post_init__(self) -> None:
        if min(self.gather_s, self.issue_timeout_s, self.probe_timeout_s, self.retry_delay_s, self.room_wait_s,
               self.resume_wait_s, self.replace_wait_s, self.replace_backoff_s) < 0:
            raise ValueError("recovery timeouts must be >= 0")
        if self.max_recoveries < 0 or self.replace_attempts < 0:
            raise ValueError("max_recoveries and replace_attempts must be >= 0")


@dataclass(eq=False)
class InFlight:
    """One request's journal entry in the caller. Times are wall clock (`time.time()`)."""

    req: GenerationRequest
    streamed: list[int] = field(default_factory=list)
    text: str = ""  # text sent to the client so far
    prefill: str | None = None
    decode: str | None = None
    phase: str = PLACED
    attempt: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    issued: asyncio.Event = field(default_factory=asyncio.Event)
    issued_at: float | None = None
    num_failures: int = 0  # attempts lost to worker failures
    num_room_waits: int = 0  # recovery attempts that found no room
    room_deadline: float | None = None  # monotonic; set by the first of those
    emitted_tokens: int = 0  # leading tokens of `streamed` whose text has gone out
    num_preemptions: int = 0
    priority_rank: int = 0  # the current attempt's: 0 interactive, 1 batch
    resume_at: asyncio.Future[PlacementChoice] | None = None  # while preempted: where it runs next
    _text_base: str = ""
    _replay: list[int] = field(default_factory=list)  # streamed tokens the attempt samples again

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def worker_request_id(self) -> str:
        return self.req.request_id if self.attempt == 0 else f"{self.req.request_id}~r{self.attempt}"

    def attempt_request(self) -> GenerationRequest:
        """What the current attempt sends to workers: the original request, or a resume."""
        if self.attempt == 0:
            return self.req
        return replace(self.resume_request(), request_id=self.worker_request_id)

    def resume_request(self) -> GenerationRequest:
        """The request a recovery runs: resumed after the tokens whose text went out."""
        done = self.streamed[: self.emitted_tokens]
        return replace(self.req, output_token_ids=tuple(done)) if done else self.req

    def touches(self, workers: frozenset[str]) -> bool:
        """Whether this request loses state if `workers` die: its decode worker always, its
        prefill worker until the KV has been delivered."""
        if self.decode in workers:
            return True
        return self.prefill in workers and self.phase in (PLACED, PREFILLING)

    def next_attempt(self) -> None:
        self.attempt += 1
        self._text_base = self.text
        self._replay = self.streamed[self.emitted_tokens:]
        self.issued.clear()
        self.issued_at = None

    def place(self, prefill: str | None, decode: str, phase: str) -> None:
        self.prefill, self.decode, self.phase = prefill, decode, phase
        self.resume_at = None

    def preempt(self) -> None:
        """Leave the workers (the caller aborts the row): wait for `resume_at`."""
        self.prefill, self.decode, self.phase = None, None, PREEMPTED
        self.resume_at = asyncio.get_running_loop().create_future()
        self.num_preemptions += 1

    def mark_issued(self) -> None:
        self.issued_at = time.time()
        self.issued.set()

    def on_event(self, event: TokenEvent) -> TokenEvent | None:
        """Journals a streamed event and rewrites it to read as one stream: the client's request
        id, the text so far counted from the first attempt, and without the tokens sampled again
        (None when nothing is left to show)."""
        out = event.output
        new_ids, logprobs = out.new_token_ids, out.logprobs
        if self._replay and new_ids:
            n = min(len(self._replay), len(new_ids))
            if tuple(self._replay[:n]) != tuple(new_ids[:n]):
                self.emitted_tokens = len(self.streamed)  # resume after all of them next time
                raise ReplayMismatch(f"{self.request_id}: resumed stream sampled {new_ids[:n]} where "
                                     f"{self._replay[:n]} was streamed")
            del self._replay[:n]
            new_ids, logprobs = new_ids[n:], logprobs[n:] if logprobs else logprobs
        if new_ids:
            now = event.emitted_at
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.streamed.extend(new_ids)
        if out.new_text or out.finished:
            self.emitted_tokens = len(out.token_ids)
        if self.attempt == 0:
            self.text = out.text
            return event
        if not new_ids and not out.new_text and not out.finished:
            return None
        stitched = replace(out, request_id=self.req.request_id, new_token_ids=new_ids, logprobs=logprobs,
                           text=self._text_base + out.text)
        self.text = stitched.text
        return replace(event, output=stitched)


@dataclass(frozen=True)
class RecoveryRecord:
    """One recovery, in the order recoveries were issued to workers."""

    request_id: str
    round: int
    position: int  # in its round's plan
    dead: tuple[str, ...]
    num_streamed: int
    first_token_at: float | None
    prefill: str | None  # where the plan resumed it (None: on a decode worker alone)
    decode: str | None  # the plan's first choice
    issued_at: float | None


Outcome = PlacementChoice | BaseException
Plan = Callable[[frozenset[str], list[InFlight]], Awaitable[list[tuple[InFlight, Outcome]]]]


@dataclass(eq=False)
class _Round:
    number: int
    dead: frozenset[str]
    waiting: dict[InFlight, asyncio.Future[PlacementChoice]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False


class RecoveryCoordinator:
    """Gathers the victims of one failure into a round and releases them in the plan's order."""

    def __init__(self, plan: Plan, in_flight: Callable[[], Sequence[InFlight]], cfg: RecoveryConfig) -> None:
        self._plan = plan
        self._in_flight = in_flight
        self.cfg = cfg
        self._open: dict[frozenset[str], _Round] = {}
        self._numbers = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.log: list[RecoveryRecord] = []

    async def recover(self, flight: InFlight, dead: frozenset[str]) -> PlacementChoice:
        """Waits for `flight`'s turn; returns where its next attempt runs, or raises what the plan
        said (no healthy worker, a refusal). The caller marks the attempt issued."""
        rnd = self._open.get(dead)
        if rnd is None or rnd.closed:
            rnd = self._open[dead] = _Round(next(self._numbers), dead)
            task = asyncio.ensure_future(self._run(rnd))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        fut: asyncio.Future[PlacementChoice] = asyncio.get_running_loop().create_future()
        rnd.waiting[flight] = fut
        rnd.changed.set()
        return await fut

    def _gathered(self, rnd: _Round) -> bool:
        """Every in-flight request that loses state with `rnd.dead` waits in this round (or in
        another one). Those still streaming, or still probing their workers, are waited for."""
        if not rnd.dead:
            return True  # a retry without a death: nobody else to wait for
        others = [r for r in self._open.values() if r is not rnd]
        return all(f in rnd.waiting or any(f in r.waiting for r in others)
                   for f in self._in_flight() if f.touches(rnd.dead))

    async def _run(self, rnd: _Round) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.gather_s
        while not self._gathered(rnd) and loop.time() < deadline:
            rnd.changed.clear()
            try:
                await asyncio.wait_for(rnd.changed.wait(), min(0.02, max(0.0, deadline - loop.time())))
            except asyncio.TimeoutError:
                pass
        rnd.closed = True
        if self._open.get(rnd.dead) is rnd:
            del self._open[rnd.dead]
        victims = [f for f, fut in rnd.waiting.items() if not fut.done()]
        try:
            plan = await self._plan(rnd.dead, victims) if victims else []
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
            for fut in rnd.waiting.values():
                if not fut.done():
                    fut.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        planned = {f for f, _ in plan}
        for f in victims:  # a plan that forgot someone must not leave it waiting forever
            if f not in planned:
                plan.append((f, RuntimeError(f"recovery plan left out {f.request_id}")))
        for position, (flight, outcome) in enumerate(plan):
            fut = rnd.waiting[flight]
            if fut.done():  # the client went away meanwhile
                continue
            if isinstance(outcome, BaseException):
                fut.set_exception(outcome)
                continue
            flight.issued.clear()
            fut.set_result(outcome)
            try:
                await asyncio.wait_for(flight.issued.wait(), self.cfg.issue_timeout_s)
            except asyncio.TimeoutError:
                logger.warning("recovery of %s was not issued within %gs; releasing the next",
                               flight.request_id, self.cfg.issue_timeout_s)
            self.log.append(RecoveryRecord(
                request_id=flight.request_id, round=rnd.number, position=position, dead=tuple(sorted(rnd.dead)),
                num_streamed=len(flight.streamed), first_token_at=flight.first_token_at,
                prefill=outcome.prefill if flight.resume_request().needs_handoff else None,
                decode=outcome.decodes[0], issued_at=flight.issued_at))
