"""Waiting for a decode row: new requests that find every decode worker full queue here, most urgent first.

Mental model: a decode worker refuses an announce while all its rows (running + reserved) are
taken. Answering the client 429 at that moment is what a router without a queue does; under load
a row frees every few hundred milliseconds, so a serving system queues the request instead, for
a bounded time. `RoomQueue` is that queue, one per router (`Router`). A refused request takes a
ticket ordered by its priority (SLO class rank first: interactive before batch; then its key, the
scheduler's urgency or its arrival time) and only the head of the queue asks again: when a row of
this caller frees (`release`), or every `poll_s` (rows freed by other callers' requests). The head
leaving wakes the next one. A new request may skip the queue only if it outranks everyone waiting.
`interactive_waiting` lets batch work resumed after a preemption yield its turn. `Patience` is
how long a waiter keeps its place: a queue that moves (a waiter served, a decode worker joined, the
rows that hold it streaming tokens) is a busy cluster, served in order, up to the most any request
waits; one where nothing has moved for a while is a stalled one, and its waiters are refused.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Iterable


class RoomQueue:
    def __init__(self, poll_s: float = 0.25) -> None:
        if poll_s <= 0:
            raise ValueError("poll_s must be positive")
        self.poll_s = poll_s
        self._heap: list[tuple[int, float, int]] = []  # (rank, key, ticket); stale tickets deleted lazily
        self._waiting: dict[int, tuple[int, float, asyncio.Event]] = {}  # ticket -> (rank, joined at, wake-up)
        self._tickets = itertools.count()
        self.num_queued = 0  # requests that had to wait, ever
        self.num_left = 0  # waiters that left the queue, ever (the queue moves while this grows)
        self.num_streamed = 0  # token events the caller's decode rows streamed, ever (`streamed`)

    def __len__(self) -> int:
        return len(self._waiting)

    def may_skip(self, rank: int, key: float) -> bool:
        """Whether a new request may ask for a row now: nobody waits, or it outranks the head."""
        head = self._head()
        return head is None or (rank, key) < self._heap[0][:2]

    def join(self, rank: int, key: float) -> int:
        ticket = next(self._tickets)
        heapq.heappush(self._heap, (rank, key, ticket))
        self._waiting[ticket] = (rank, time.monotonic(), asyncio.Event())
        self.num_queued += 1
        self._wake_head()  # the newcomer may be the new head
        return ticket

    def leave(self, ticket: int) -> None:
        if self._waiting.pop(ticket, None) is not None:
            self.num_left += 1
            self._wake_head()

    def release(self) -> None:
        """A row of this caller's may have freed: the head asks again."""
        self._wake_head()

    def streamed(self) -> None:
        """A row of this caller's streamed a token: the rows the waiters wait for are working."""
        self.num_streamed += 1

    def oldest_wait_s(self) -> float:
        """How long the longest waiter has waited so far; 0 when nobody waits."""
        return time.monotonic() - min(joined for _, joined, _ in self._waiting.values()) if self._waiting else 0.0

    def interactive_waiting(self) -> bool:
        return any(rank == 0 for rank, _, _ in self._waiting.values())

    async def turn(self, ticket: int, timeout_s: float) -> bool:
        """Waits until `ticket` heads the queue and a row may have freed (woken, or `poll_s`
        passed); False if `timeout_s` passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        _, _, event = self._waiting[ticket]
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
            self._waiting[head][2].set()


class Patience:
    """One waiter's clock: it waits `wait_s` after the queue last moved (a waiter left it, a decode
    worker joined, a row streamed: `RoomQueue.num_streamed`, or `worker_steps`, the decode rows the
    workers report, changed: rows held by other callers' requests), and on while capacity is on its
    way (`coming`: a decode worker being added), but never past `max_wait_s` in all."""

    def __init__(self, room: RoomQueue, decodes: Callable[[], Iterable[str]], coming: Callable[[], bool],
                 wait_s: float, max_wait_s: float, worker_steps: Callable[[], int] = lambda: 0) -> None:
        self.start = time.monotonic()
        self.wait_s, self.max_wait_s = wait_s, max(wait_s, max_wait_s)
        self._room, self._decodes, self._coming, self._steps = room, decodes, coming, worker_steps
        self._seen = self._state()
        self._deadline = self.start + wait_s
        self._limit = self.start + self.max_wait_s

    def _state(self) -> tuple[set[str], int, int, int]:
        return set(self._decodes()), self._room.num_left, self._room.num_streamed, self._steps()

    def left_s(self) -> float:
        """Seconds this waiter may still wait; 0 once its wait is over."""
        now = time.monotonic()
        state = self._state()
        if not state[0] <= self._seen[0] or state[1:] != self._seen[1:]:  # the queue moved
            self._deadline = min(self._limit, now + self.wait_s)
        self._seen = state
        if now >= self._deadline and self._coming():
            self._deadline = min(self._limit, now + self._room.poll_s)
        return max(0.0, self._deadline - now)

    def why_over(self) -> str:
        """Why the wait ended, for the refusal: the bound, or a queue where nothing moved."""
        waited = time.monotonic() - self.start
        if time.monotonic() >= self._limit:
            return f"it waited {waited:.0f}s, the most a request waits for a row (room_max_wait_s)"
        return (f"nothing moved for {self.wait_s:g}s: no row freed or streamed, no decode worker joined or "
                f"coming (waited {waited:.0f}s)")
