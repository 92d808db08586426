"""Preemption in the request path: a decoding batch request gives its decode row to more urgent work.

Mental model: the scheduler decides (its orders reach `PDClient.preempt` / `resume` through a
`ScheduledPlacement`), and the caller carries them out here. `stop` aborts the row on its decode
worker (blocks freed at once) while the client's stream stays open; the request then waits in
phase `preempted` until the scheduler places it again (`resume`), and runs as a new attempt from
the tokens already streamed, exactly like a recovery, so the client sees one stream with a pause.
A scheduler that stays silent (down, or `RecoveryConfig.resume_wait_s` passed) leaves the placement
to the local policy. A resumed request takes a row without asking for one, so it first lets this
caller's interactive requests waiting for a row go (`RoomQueue.interactive_waiting`).

Two details keep the row for the request it was freed for: announces to a worker first wait for
the aborts under way there (`wait_freed`), and an interactive request that finds no row anyway
(the scheduler's view lagged) stops this caller's batch row there that is cheapest to recompute
(`make_room`), which the scheduler then resumes like its own victims.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from actors.placement import NoWorkers, PlacementChoice
from actors.recovery import DECODING, PREEMPTED, InFlight

if TYPE_CHECKING:
    from actors.pd_client import PDClient

logger = logging.getLogger(__name__)


async def _settled(ref: Awaitable[Any]) -> None:
    """Waits for `ref` whatever it ends with (its error is the caller's to ignore)."""
    with contextlib.suppress(Exception):
        await ref


class Preemptions:
    """One caller's preemptions (`PDClient.preemptions`)."""

    def __init__(self, client: "PDClient") -> None:
        self.client = client
        self.num_preempted = 0
        self.num_resumed_locally = 0  # preempted requests the scheduler did not place in time
        self._freeing: dict[str, list[Any]] = {}  # decode worker -> aborts of preempted rows under way

    def stop(self, request_id: str) -> bool | None:
        """Stops `request_id`'s decode row now. True: stopped (now or before); False: it cannot
        be stopped now (its KV is still being computed or moved, or it is between attempts) and
        keeps running; None: not in flight."""
        flight = self.client.flights.get(request_id)
        if flight is None:
            return None
        if flight.phase == PREEMPTED:
            return True
        decode = flight.decode
        if flight.phase != DECODING or decode is None or not flight.issued.is_set():
            return False
        worker_rid = flight.worker_request_id
        flight.preempt()
        self.num_preempted += 1
        self._freeing.setdefault(decode, []).append(self.client.decodes[decode].abort.remote(worker_rid))
        logger.info("%s: preempted on %s after %d tokens", request_id, decode, len(flight.streamed))
        return True

    def resume(self, request_id: str, choice: PlacementChoice) -> bool:
        """Where a preempted request runs next; False if it is not waiting (finished, gone, or
        already placed again)."""
        flight = self.client.flights.get(request_id)
        if flight is None or flight.resume_at is None or flight.resume_at.done():
            return False
        flight.resume_at.set_result(choice)
        return True

    async def wait_resumed(self, flight: InFlight) -> PlacementChoice:
        """Where a preempted request runs next: the scheduler's placement, or the local policy's
        when the scheduler is unreachable or silent past `resume_wait_s`; then waits while
        interactive requests wait for a row, up to the same deadline."""
        assert flight.resume_at is not None
        c = self.client
        deadline = time.monotonic() + c.recovery_cfg.resume_wait_s
        while not flight.resume_at.done():
            try:
                await asyncio.wait_for(asyncio.shield(flight.resume_at), 0.5)
                break
            except asyncio.TimeoutError:
                pass
            if c.scheduled is not None and c.scheduled.available and time.monotonic() < deadline:
                continue
            loads = await c.loads()
            try:
                choice = c.local_placement.place(flight.resume_request(), [loads[n] for n in c.prefills],
                                                 [loads[n] for n in c.decodes])
            except NoWorkers:
                continue  # a replacement may be starting; the scheduler may still answer
            if not flight.resume_at.done():
                flight.resume_at.set_result(choice)
                self.num_resumed_locally += 1
                logger.warning("%s: preempted and not placed again by the scheduler; resuming on %s",
                               flight.request_id, choice.decodes[0])
        while c.room.interactive_waiting() and time.monotonic() < deadline:
            await asyncio.sleep(c.room.poll_s)
        return flight.resume_at.result()

    def make_room(self, decode: str) -> None:
        """An interactive request found no row on `decode`: unless a row there is already being
        freed, stop this caller's batch row on it that is cheapest to recompute and tell the
        scheduler (when it allows preemption)."""
        scheduled = self.client.scheduled
        if scheduled is None or not scheduled.preempt_batch or self._freeing.get(decode):
            return
        victims = [f for f in self.client.flights.values()
                   if f.decode == decode and f.phase == DECODING and f.priority_rank > 0 and f.issued.is_set()]
        if not victims:
            return
        victim = min(victims, key=lambda f: (f.req.num_prompt_tokens + len(f.streamed), f.request_id))
        if self.client.preempt(victim.request_id):
            scheduled.on_preempted(victim)

    async def wait_freed(self, decode: str, timeout_s: float) -> None:
        """Until the aborts of rows just preempted on `decode` have completed."""
        freeing = self._freeing.pop(decode, None)
        if freeing:
            await asyncio.wait([asyncio.ensure_future(_settled(r)) for r in freeing], timeout=timeout_s)
