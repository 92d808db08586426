"""Preemption in the request path: a decoding batch request gives its decode row to more urgent work.

Mental model: the scheduler decides (its orders reach `Router.preempt` / `resume` through the
`ControlPlane`), and the router carries them out here. `stop` aborts the row on its decode
worker (blocks freed at once) while the client's stream stays open; the request then waits in
phase `preempted` until the scheduler places it again (`resume`), and runs as a new attempt from
the tokens already streamed, exactly like a recovery, so the client sees one stream with a pause.
A scheduler that stays silent (down, or `RecoveryConfig.resume_wait_s` passed) leaves the placement
to the local policy. A resumed request takes a row without asking for one, so it first lets this
router's interactive requests waiting for a row go (`RoomQueue.interactive_waiting`).

Two details keep the row for the request it was freed for: announces to a worker first wait for
the aborts under way there (`wait_freed`), and an interactive request that finds no row anyway
(the scheduler's view lagged) stops this router's batch row there that is cheapest to recompute
(`make_room`), which the scheduler then resumes like its own victims.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from actors.errors import NoWorkers
from cluster.router.choice import PlacementChoice
from cluster.router.control import ControlPlane
from cluster.router.flight import DECODING, PREEMPTED, InFlight
from cluster.router.handles import WorkerHandle
from cluster.router.room import RoomQueue

logger = logging.getLogger(__name__)


async def _settled(ref: Awaitable[Any]) -> None:
    """Waits for `ref` whatever it ends with (its error is the caller's to ignore)."""
    with contextlib.suppress(Exception):
        await ref


class Preemptions:
    """One router's preemptions (`Router.preemptions`), over its flights, decode handles and room
    queue. `place_locally` is the router's local policy for a request; `control` its control plane."""

    def __init__(self, flights: Mapping[str, InFlight], decodes: Mapping[str, WorkerHandle], room: RoomQueue,
                 control: ControlPlane | None, place_locally: Callable[[InFlight], Awaitable[PlacementChoice]],
                 resume_wait_s: float) -> None:
        self.flights, self.decodes, self.room, self.control = flights, decodes, room, control
        self.place_locally = place_locally
        self.resume_wait_s = resume_wait_s
        self.num_preempted = 0
        self.num_resumed_locally = 0  # preempted requests the scheduler did not place in time
        self._freeing: dict[str, list[Any]] = {}  # decode worker -> aborts of preempted rows under way

    def stop(self, request_id: str) -> bool | None:
        """Stops `request_id`'s decode row now. True: stopped (now or before); False: it cannot
        be stopped now (its KV is still being computed or moved, or it is between attempts) and
        keeps running; None: not in flight."""
        flight = self.flights.get(request_id)
        if flight is None:
            return None
        if flight.phase == PREEMPTED:
            return True
        decode = flight.decode
        if flight.phase != DECODING or decode is None or decode not in self.decodes or not flight.issued.is_set():
            return False  # (a stream lent to a prefill worker keeps its row too)
        worker_rid = flight.worker_request_id
        flight.preempt()
        self.num_preempted += 1
        self._freeing.setdefault(decode, []).append(self.decodes[decode].abort(worker_rid))
        logger.info("%s: preempted on %s after %d tokens", request_id, decode, len(flight.streamed))
        return True

    def resume(self, request_id: str, choice: PlacementChoice) -> bool:
        """Where a preempted request runs next; False if it is not waiting (finished, gone, or
        already placed again)."""
        flight = self.flights.get(request_id)
        if flight is None or flight.resume_at is None or flight.resume_at.done():
            return False
        flight.resume_at.set_result(choice)
        return True

    async def wait_resumed(self, flight: InFlight) -> PlacementChoice:
        """Where a preempted request runs next: the scheduler's placement, or the local policy's
        when the scheduler is unreachable or silent past `resume_wait_s`; then waits while
        interactive requests wait for a row, up to the same deadline."""
        assert flight.resume_at is not None
        deadline = time.monotonic() + self.resume_wait_s
        while not flight.resume_at.done():
            try:
                await asyncio.wait_for(asyncio.shield(flight.resume_at), 0.5)
                break
            except asyncio.TimeoutError:
                pass
            if self.control is not None and self.control.available and time.monotonic() < deadline:
                continue
            try:
                choice = await self.place_locally(flight)
            except NoWorkers:
                continue  # a replacement may be starting; the scheduler may still answer
            if not flight.resume_at.done():
                flight.resume_at.set_result(choice)
                self.num_resumed_locally += 1
                logger.warning("%s: preempted and not placed again by the scheduler; resuming on %s",
                               flight.request_id, choice.decodes[0])
        while self.room.interactive_waiting() and time.monotonic() < deadline:
            await asyncio.sleep(self.room.poll_s)
        return flight.resume_at.result()

    def make_room(self, decode: str) -> None:
        """An interactive request found no row on `decode`: unless a row there is already being
        freed, stop this router's batch row on it that is cheapest to recompute and tell the
        scheduler (when it allows preemption)."""
        control = self.control
        if control is None or not control.preempt_batch or self._freeing.get(decode):
            return
        victims = [f for f in self.flights.values()
                   if f.decode == decode and f.phase == DECODING and f.priority_rank > 0 and f.issued.is_set()]
        if not victims:
            return
        victim = min(victims, key=lambda f: (f.req.num_prompt_tokens + len(f.streamed), f.request_id))
        if self.stop(victim.request_id):
            control.on_preempted(victim)

    async def wait_freed(self, decode: str, timeout_s: float) -> None:
        """Until the aborts of rows just preempted on `decode` have completed."""
        freeing = self._freeing.pop(decode, None)
        if freeing:
            await asyncio.wait([asyncio.ensure_future(_settled(r)) for r in freeing], timeout=timeout_s)
