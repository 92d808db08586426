"""Waiting for a decode row: new requests that find every decode worker full queue here, most urgent first.

Mental model: a decode worker refuses an announce while all its rows (running + reserved) are
taken. Answering the client 429 at that moment is what a router without a queue does; under load
a row frees every few hundred milliseconds, so a serving system queues the request instead, for
a bounded time. `RoomQueue` is that queue, one per router (`Router`). A refused request takes a
ticket ordered by its priority (SLO class rank first: interactive before batch; then its key, the
scheduler's urgency or its arrival time) and only the head of the queue asks again: when a row of
this caller frees (`release`), or every `poll_s` (rows freed by other callers' requests). The head
leaving wakes the next one. A new request may skip the queue only if it outranks everyone waiting.
`interactive_waiting` lets batch work resumed after a preemption yield its turn.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class RoomQueue:
    def __init__(self, poll_s: float = 0.25) -> None:
        if poll_s <= 0:
            raise ValueError("poll_s must be positive")
        self.poll_s = poll_s
        self._heap: list[tuple[int, float, int]] = []  # (rank, key, ticket); stale tickets deleted lazily
        self._waiting: dict[int, tuple[int, asyncio.Event]] = {}  # ticket -> (rank, wake-up)
        self._tickets = itertools.count()
        self.num_queued = 0  # requests that had to wait, ever

    def __len__(self) -> int:
        return len(self._waiting)

    def may_skip(self, rank: int, key: float) -> bool:
        """Whether a new request may ask for a row now: nobody waits, or it outranks the head."""
        head = self._head()
        return head is None or (rank, key) < self._heap[0][:2]

    def join(self, rank: int, key: float) -> int:
        ticket = next(self._tickets)
        heapq.heappush(self._heap, (rank, key, ticket))
        self._waiting[ticket] = (rank, asyncio.Event())
        self.num_queued += 1
        self._wake_head()  # the newcomer may be the new head
        return ticket

    def leave(self, ticket: int) -> None:
        if self._waiting.pop(ticket, None) is not None:
            self._wake_head()

    def release(self) -> None:
        """A row of this caller's may have freed: the head asks again."""
        self._wake_head()

    def interactive_waiting(self) -> bool:
        return any(rank == 0 for rank, _ in self._waiting.values())

    async def turn(self, ticket: int, timeout_s: float) -> bool:
        """Waits until `ticket` heads the queue and a row may have freed (woken, or `poll_s`
        passed); False if `timeout_s` passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        _, event = self._waiting[ticket]
        while True:
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(event.wait(), min(self.poll_s, left))
            except asyncio.TimeoutError:
                pass
            event.clear()
            if self._head() == ticket:
                return True

    def _head(self) -> int | None:
        while self._heap and self._heap[0][2] not in self._waiting:
            heapq.heappop(self._heap)
        return self._heap[0][2] if self._heap else None

    def _wake_head(self) -> None:
        head = self._head()
        if head is not None:
            self._waiting[head][1].set()
