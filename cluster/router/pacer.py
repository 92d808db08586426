"""ReportPacer: when the scheduler link's reporter sends its next round.

While something is in flight or unacknowledged the reporter reports every `busy_s`; once a round
is acknowledged with nothing to tell (`idle = True`) it only heartbeats, every `idle_s`, and the
next event (`poke`, from the event loop's thread) ends that wait at once. So an idle ingress
wakes a few times a minute, not several times a second. After such a spell the scheduler's view of
the workers may be `idle_s` old (a replica that joined meanwhile is unknown to it): the first
request waits for one round that starts after it (`fresh_round`), a few milliseconds.
"""

from __future__ import annotations

import asyncio


class ReportPacer:
    def __init__(self, busy_s: float, idle_s: float) -> None:
        self.busy_s, self.idle_s = busy_s, max(busy_s, idle_s)
        self.idle = False  # the last acknowledged round found nothing to tell: heartbeats only
        self._wake = asyncio.Event()
        self._ended = asyncio.Event()  # pulsed at the end of every round
        self._started = self._done = 0  # rounds begun, rounds ended

    def new_loop(self) -> None:
        """The reporter moved to another event loop: fresh events bound to it."""
        self._wake, self._ended = asyncio.Event(), asyncio.Event()

    def poke(self) -> None:
        """Something to report: an idle reporter goes back to `busy_s` now."""
        self.idle = False
        self._wake.set()

    def round_starts(self) -> None:
        """Before a round: a poke during it keeps the next wait short."""
        self._wake.clear()
        self.idle = False  # until the round is acknowledged with nothing left to tell
        self._started += 1

    def round_ends(self) -> None:
        self._done = self._started
        self._ended.set()

    async def fresh_round(self) -> None:
        """Until a round that begins after this call has ended (the caller bounds the wait)."""
        want = self._started + 1
        self.poke()
        while self._done < want:
            self._ended.clear()
            await self._ended.wait()

    async def pause(self) -> None:
        if not self.idle:
            await asyncio.sleep(self.busy_s)
            return
        try:
            await asyncio.wait_for(self._wake.wait(), self.idle_s)
        except asyncio.TimeoutError:
            pass
