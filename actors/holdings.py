"""HoldingsLog: a set of block hashes as numbered changes, so any number of readers can follow it.

Mental model: the owner (a worker's prefix cache, a prefix-pool store) hands in what it holds now
(`update`, a whole set, taken when it is cheap to take); the log diffs it with the last one and
keeps the last `max_changes` differences, numbered 1, 2, ... within this process (`incarnation`).
A reader passes how far it has applied (incarnation, change number) and gets the changes after it,
or, when its cursor is missing, of another process, or older than the changes kept, the whole set
(`full`). So readers may overlap, repeat and restart; the scheduler's `TelemetryInbox` keeps only
what its cursor has not covered, and each change is applied exactly once.

Not thread-safe: its owners serialise calls (a lock, or a Ray actor's one method at a time).
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

Change = tuple[int, tuple[int, ...], tuple[int, ...]]  # (number, hashes added, hashes removed)


@dataclass(frozen=True, slots=True)
class HoldingsRead:
    """What a reader gets: the changes after its cursor up to `seq`, or the whole set at `seq`."""

    incarnation: str
    seq: int
    changes: tuple[Change, ...] = ()
    full: frozenset[int] | None = None


class HoldingsLog:
    def __init__(self, max_changes: int = 64, incarnation: str | None = None) -> None:
        if max_changes < 1:
            raise ValueError("max_changes must be >= 1")
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self._changes: deque[Change] = deque(maxlen=max_changes)
        self._seq = 0
        self._held: frozenset[int] = frozenset()

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def held(self) -> frozenset[int]:
        return self._held

    def update(self, held: Iterable[int]) -> bool:
        """Takes `held` as the set now; records a change if it differs. True when it did."""
        now = held if isinstance(held, frozenset) else frozenset(held)
        added, removed = tuple(now - self._held), tuple(self._held - now)
        if not added and not removed:
            return False
        self._seq += 1
        self._changes.append((self._seq, added, removed))
        self._held = now
        return True

    def read(self, incarnation: str | None, seq: int) -> HoldingsRead:
        """The changes after change `seq` of process `incarnation`, or the whole set when those
        are not all kept (or the cursor is of another process, or none)."""
        oldest = self._changes[0][0] if self._changes else self._seq + 1
        if incarnation == self.incarnation and oldest - 1 <= seq <= self._seq:
            return HoldingsRead(self.incarnation, self._seq, tuple(c for c in self._changes if c[0] > seq))
        return HoldingsRead(self.incarnation, self._seq, full=self._held)
