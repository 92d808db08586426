"""Recovery rounds: the victims of one failure, gathered and released in the plan's order.

Mental model: the requests a dead worker held fail within moments of each other, and the
`RecoveryCoordinator` gathers them into one round (until every in-flight request touching the
dead workers has reported, or `gather_s` passed), asks for a plan (the cluster scheduler's
recovery plan, most urgent remaining SLO budget first, or arrival order without one), and
releases them one at a time: the next is released once the previous one's first call to a worker
was issued. `RecoveryRecord`s log the issue order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from cluster.router.choice import PlacementChoice
from cluster.router.config import RecoveryConfig
from cluster.router.flight import InFlight

logger = logging.getLogger(__name__)


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

    def lent(self, flight: InFlight, dead: frozenset[str], choice: PlacementChoice) -> PlacementChoice:
        """Logs a recovery placed outside a round (round 0: on a prefill worker lent while no decode
        worker is up) and returns `choice`."""
        self.log.append(RecoveryRecord(
            request_id=flight.request_id, round=0, position=0, dead=tuple(sorted(dead)),
            num_streamed=len(flight.streamed), first_token_at=flight.first_token_at, prefill=None,
            decode=choice.decodes[0], issued_at=None))
        return choice

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
