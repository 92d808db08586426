"""An LRU store of KV block hashes (a GPU's prefix cache, or the shared pool), with deltas.

Mental model: the simulator only needs *which* prefix blocks a store holds. Hits are found by
walking the request's hash chain from the start; a chain is touched last-block-first so that its
first blocks are the most recently used and eviction takes tails before heads (as engines do:
a parent block is never freed before its children). The added/removed sets since the last
report are what a real worker would send the scheduler.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockCache:
    def __init__(self, capacity_blocks: int, track_deltas: bool = False) -> None:
        self.capacity = max(0, capacity_blocks)
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.track_deltas = track_deltas
        self._added: set[int] = set()
        self._removed: set[int] = set()

    def longest_prefix(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: Sequence[int]) -> None:
        if not self.capacity:
            return
        lru = self._lru
        for h in reversed(hashes[: self.capacity]):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                if self.track_deltas:
                    if h in self._removed:
                        self._removed.discard(h)
                    else:
                        self._added.add(h)
        while len(lru) > self.capacity:
            h, _ = lru.popitem(last=False)
            if self.track_deltas:
                if h in self._added:
                    self._added.discard(h)
                else:
                    self._removed.add(h)

    def take_deltas(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        added, removed = tuple(self._added), tuple(self._removed)
        self._added.clear()
        self._removed.clear()
        return added, removed

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: object) -> bool:
        return h in self._lru
