"""ReportPacer: when the scheduler link's reporter sends its next round.

While something is in flight or unacknowledged the reporter reports every `busy_s`; once a round
is acknowledged with nothing to tell (`idle = True`) it only heartbeats, every `idle_s`, and the
next event (`poke`, from the event loop's thread) ends that wait at once. So an idle ingress
wakes a few times a minute, not several times a second, and a new request is not delayed by it.
"""

from __future__ import annotations

import asyncio


class ReportPacer:
    def __init__(self, busy_s: float, idle_s: float) -> None:
        self.busy_s, self.idle_s = busy_s, max(busy_s, idle_s)
        self.idle = False  # the last acknowledged round found nothing to tell: heartbeats only
        self._wake = asyncio.Event()

    def new_loop(self) -> None:
        """The reporter moved to another event loop: a fresh event bound to it."""
        self._wake = asyncio.Event()

    def poke(self) -> None:
        """Something to report: an idle reporter goes back to `busy_s` now."""
        self.idle = False
        self._wake.set()

    def round_starts(self) -> None:
        """Before a round: a poke during it keeps the next wait short."""
        self._wake.clear()
        self.idle = False  # until the round is acknowledged with nothing left to tell

    async def pause(self) -> None:
        if not self.idle:
            await asyncio.sleep(self.busy_s)
            return
        try:
            await asyncio.wait_for(self._wake.wait(), self.idle_s)
        except asyncio.TimeoutError:
            pass
