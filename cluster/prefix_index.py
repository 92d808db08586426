"""Prefix index: which worker (or the shared pool) holds which KV blocks, by chained block hash.

Mental model: block hashes are chained, so a worker holding the hash of block k of a prompt holds
the KV of the whole prefix up to k *if it also holds blocks 0..k-1*. Engines evict leaf blocks
first (a block is freed only after its descendants), so what a worker holds is prefix-closed in
practice, and the longest prefix a worker holds is found by galloping + binary search over the
request's hash chain: O(h log n) set lookups for h candidate holders and n blocks, never a scan of
the prompt, which keeps a 100k-token prompt's lookup in the microseconds. When holdings are not
prefix-closed the match is an estimate; the prefill worker verifies block by block anyway.

Holdings arrive as deltas in worker reports (`add` / `remove`) or whole (`replace`). The pool is
one more holder named `POOL`: the union of its stores' holdings, which arrive per store as
telemetry of a holder named `pool_store(store_id)`; `PoolHoldings` keeps each store's set and
moves a hash into or out of `POOL` only when the first store gains it or the last one loses it
(the ring puts each block on one store, but a store leaving the ring hands its keys to another).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from cluster.descriptors import WorkerName

POOL = WorkerName("<pool>")
_POOL_STORE = "<pool>/"


def pool_store(store_id: str) -> WorkerName:
    """The telemetry name of one store of the shared prefix-cache pool."""
    return WorkerName(_POOL_STORE + store_id)


def is_pool_store(name: str) -> bool:
    return name.startswith(_POOL_STORE)


class PrefixIndex:
    """block hash -> holders, and holder -> block hashes; the two maps always agree
    (`check_integrity`)."""

    def __init__(self) -> None:
        self._holders: dict[int, set[WorkerName]] = {}
        self._held: dict[WorkerName, set[int]] = {}

    def add(self, worker: WorkerName, hashes: Iterable[int]) -> None:
        held = self._held.setdefault(worker, set())
        for h in hashes:
            if h not in held:
                held.add(h)
                self._holders.setdefault(h, set()).add(worker)

    def remove(self, worker: WorkerName, hashes: Iterable[int]) -> None:
        held = self._held.get(worker)
        if not held:
            return
        for h in hashes:
            if h in held:
                held.discard(h)
                holders = self._holders[h]
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def replace(self, worker: WorkerName, hashes: Iterable[int]) -> None:
        self.drop(worker)
        self.add(worker, hashes)

    def drop(self, worker: WorkerName) -> None:
        """Forget a holder (a dead worker's cache is gone with it)."""
        held = self._held.pop(worker, None)
        if held:
            for h in held:
                holders = self._holders[h]
                holders.discard(worker)
                if not holders:
                    del self._holders[h]

    def num_blocks(self, worker: WorkerName) -> int:
        return len(self._held.get(worker, ()))

    def _longest(self, held: set[int], hashes: Sequence[int]) -> int:
        # hashes[0] is held. Gallop to bracket the first miss, then bisect; invariant:
        # hashes[lo - 1] held, hashes[hi - 1] not held (assuming prefix-closed holdings).
        n = len(hashes)
        lo, step = 1, 1
        while True:
            probe = lo + step
            if probe >= n:
                if hashes[n - 1] in held:
                    return n
                hi = n
                break
            if hashes[probe - 1] in held:
                lo, step = probe, step * 2
            else:
                hi = probe
                break
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if hashes[mid - 1] in held:
                lo = mid
            else:
                hi = mid
        return lo

    def match(self, hashes: Sequence[int]) -> dict[WorkerName, int]:
        """Number of leading blocks of `hashes` each holder has; holders with none are absent."""
        if not hashes:
            return {}
        first = self._holders.get(hashes[0])
        if not first:
            return {}
        return {w: self._longest(self._held[w], hashes) for w in first}

    def check_integrity(self) -> None:
        for w, held in self._held.items():
            for h in held:
                assert w in self._holders.get(h, ()), f"{w} holds {h} but the reverse map disagrees"
        for h, holders in self._holders.items():
            assert holders, f"hash {h} has an empty holder set"
            for w in holders:
                assert h in self._held.get(w, ()), f"reverse map says {w} holds {h}; {w} disagrees"


class PoolHoldings:
    """Each pool store's block hashes, and how many stores hold each; keeps `index`'s `POOL`
    holder equal to their union."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._stores: dict[WorkerName, set[int]] = {}
        self._count: dict[int, int] = {}

    def replace(self, store: WorkerName, hashes: Iterable[int]) -> None:
        new = set(hashes)
        old = self._stores.get(store, set())
        self.change(store, new - old, old - new)

    def change(self, store: WorkerName, added: Iterable[int], removed: Iterable[int]) -> None:
        held = self._stores.setdefault(store, set())
        gained, lost = [], []
        for h in removed:
            if h in held:
                held.discard(h)
                n = self._count[h] - 1
                if n:
                    self._count[h] = n
                else:
                    del self._count[h]
                    lost.append(h)
        for h in added:
            if h not in held:
                held.add(h)
                n = self._count.get(h, 0)
                self._count[h] = n + 1
                if not n:
                    gained.append(h)
        self.index.remove(POOL, lost)
        self.index.add(POOL, gained)

    def num_blocks(self, store: WorkerName) -> int:
        return len(self._stores.get(store, ()))

    def check_integrity(self) -> None:
        union = set().union(*self._stores.values()) if self._stores else set()
        assert union == set(self._count), "per-store sets and counts disagree"
        assert all(n == sum(h in s for s in self._stores.values()) for h, n in self._count.items()), "counts"
