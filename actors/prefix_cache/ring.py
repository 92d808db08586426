"""Consistent hashing of block hashes onto prefix-cache stores.

Mental model: a circle of 64-bit points. Each store owns `vnodes_per_store` points on it (its
"virtual nodes"); a key lands at its own point and belongs to the first store point clockwise from
it. Adding a store only inserts points, so the only keys that move are the ones that now land
just before a new point, and they all move *to* the new store (about 1/(N+1) of them). Removing a
store only deletes its points, so only its own keys move. Many virtual nodes per store smooth out
the share each store gets.

Every point comes from blake2b, never Python's per-process salted `hash()`, so every process
(prefill actors, the router, the pool client) computes the same owner for the same key. Keys are
re-hashed onto the circle even though block hashes are already uniform, so the placement does not
depend on how callers make their keys (tests use small integers).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable
from typing import NewType

from actors.engine.block_hash import HASH_BYTES, BlockHash

StoreId = NewType("StoreId", str)

DEFAULT_VNODES_PER_STORE = 64


class EmptyRing(LookupError):
    """A key was routed while the ring has no store (every store failed or none was added)."""


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def key_point(block_hash: BlockHash) -> int:
    """Where a block hash sits on the circle (raises OverflowError outside 0..2**128-1)."""
    return _point(b"k" + block_hash.to_bytes(HASH_BYTES, "little"))


def vnode_points(store_id: StoreId, vnodes_per_store: int) -> list[int]:
    # The b"v" / b"k" prefixes keep store points and key points in separate input domains.
    return [_point(b"v" + f"{store_id}#{i}".encode()) for i in range(vnodes_per_store)]


class HashRing:
    """Maps each BlockHash to one store id. Membership changes are rare, lookups are hot: the
    circle is kept as two parallel sorted lists and rebuilt on `add` / `remove`."""

    def __init__(
        self, store_ids: Iterable[StoreId] = (), vnodes_per_store: int = DEFAULT_VNODES_PER_STORE
    ) -> None:
        if vnodes_per_store <= 0:
            raise ValueError(f"vnodes_per_store must be positive, got {vnodes_per_store}")
        self.vnodes_per_store = vnodes_per_store
        self._members: set[StoreId] = set()
        self._points: list[int] = []  # sorted
        self._point_owner: list[StoreId] = []  # _point_owner[i] owns _points[i]
        for store_id in store_ids:
            self.add(store_id)

    @property
    def store_ids(self) -> list[StoreId]:
        return sorted(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, store_id: object) -> bool:
        return store_id in self._members

    def add(self, store_id: StoreId) -> None:
        if not store_id:
            raise ValueError("store id must be a non-empty string")
        if store_id in self._members:
            raise ValueError(f"store {store_id!r} is already on the ring")
        self._members.add(store_id)
        self._rebuild()

    def remove(self, store_id: StoreId) -> None:
        if store_id not in self._members:
            raise KeyError(f"store {store_id!r} is not on the ring")
        self._members.remove(store_id)
        self._rebuild()

    def _rebuild(self) -> None:
        # Ties on a 64-bit point are practically impossible; sorting by (point, store id) still
        # makes the winner deterministic, independent of the order stores were added.
        pairs = sorted(
            (p, s) for s in self._members for p in vnode_points(s, self.vnodes_per_store)
        )
        self._points = [p for p, _ in pairs]
        self._point_owner = [s for _, s in pairs]

    def owner(self, block_hash: BlockHash) -> StoreId:
        if not self._points:
            raise EmptyRing("no prefix-cache store on the ring")
        i = bisect.bisect_right(self._points, key_point(block_hash))
        return self._point_owner[i % len(self._points)]  # past the last point wraps to the first
