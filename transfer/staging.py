"""A fixed, page-aligned host buffer carved into variable-size regions: the staging memory a transport
registers once and moves every shard through.

Mental model: first-fit over a sorted free list, neighbours merged on free. Regions are rounded up to
`ALIGN` so every shard starts on its own cache line (and page, for large ones). `alloc` can wait,
bounded by a deadline, for space that a consumer frees from another thread.
"""

from __future__ import annotations

import bisect
import threading
import time

import numpy as np

ALIGN = 4096


def _round_up(n: int) -> int:
    return max(ALIGN, (n + ALIGN - 1) // ALIGN * ALIGN)


class StagingArena:
    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = _round_up(size_bytes)
        # One spare page so the first region can start on a page boundary.
        self._raw = np.empty(self.size_bytes + ALIGN, dtype=np.uint8)
        skip = -self._raw.ctypes.data % ALIGN
        self.buf = self._raw[skip : skip + self.size_bytes]
        self.buf.fill(0)  # fault every page in now: first touches inside a transfer cost 5-10x
        self.base_addr = int(self.buf.ctypes.data)
        self._cond = threading.Condition()
        self._starts = [0]  # free regions, sorted by start; parallel lists
        self._sizes = [self.size_bytes]
        self._used: dict[int, int] = {}  # start -> rounded size

    @property
    def in_use_bytes(self) -> int:
        with self._cond:
            return sum(self._used.values())

    def try_alloc(self, num_bytes: int) -> int | None:
        """Offset of a free region of at least `num_bytes`, or None when none fits right now."""
        need = _round_up(num_bytes)
        with self._cond:
            for i, size in enumerate(self._sizes):
                if size >= need:
                    start = self._starts[i]
                    if size == need:
                        del self._starts[i], self._sizes[i]
                    else:
                        self._starts[i] += need
                        self._sizes[i] -= need
                    self._used[start] = need
                    return start
        return None

    def alloc(self, num_bytes: int, deadline: float, abandon: threading.Event | None = None) -> int | None:
        """Like `try_alloc`, waiting for frees until `deadline` (time.monotonic) or until `abandon`
        is set; None then. A request larger than the arena fails at once with ValueError."""
        if _round_up(num_bytes) > self.size_bytes:
            raise ValueError(f"{num_bytes} bytes exceed the staging buffer of {self.size_bytes} bytes")
        while True:
            off = self.try_alloc(num_bytes)
            if off is not None:
                return off
            left = deadline - time.monotonic()
            if left <= 0 or (abandon is not None and abandon.is_set()):
                return None
            with self._cond:
                # short waits so a set `abandon` is noticed without a notify from its setter
                self._cond.wait(min(left, 0.05))

    def free(self, offset: int) -> None:
        with self._cond:
            size = self._used.pop(offset)
            i = bisect.bisect_left(self._starts, offset)
            self._starts.insert(i, offset)
            self._sizes.insert(i, size)
            if i + 1 < len(self._starts) and offset + size == self._starts[i + 1]:
                self._sizes[i] += self._sizes.pop(i + 1)
                self._starts.pop(i + 1)
            if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:
                self._sizes[i - 1] += self._sizes.pop(i)
                self._starts.pop(i)
            self._cond.notify_all()

    def view(self, offset: int, num_bytes: int) -> memoryview:
        return memoryview(self.buf[offset : offset + num_bytes])

    def check_integrity(self) -> None:
        """Free and used regions tile the buffer exactly, with no two free neighbours."""
        with self._cond:
            free = [(s, z, False) for s, z in zip(self._starts, self._sizes)]
            spans = sorted(free + [(s, z, True) for s, z in self._used.items()])
            at = 0
            prev_free = False
            for start, size, used in spans:
                assert start == at and size > 0, (start, at, size)
                assert used or not prev_free, f"free regions at {start} not merged"
                prev_free = not used
                at += size
            assert at == self.size_bytes, (at, self.size_bytes)
