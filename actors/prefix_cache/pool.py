"""The client side of the prefix-cache pool: N stores, each block on the store the ring picks.

Mental model: a prefix is a chain of block hashes, and the chain is only useful up to its first
missing block. Each hash is routed to its owner (consistent hashing, `ring.py`); a lookup sends
every owner its share of the chain at once, and each owner answers for its share's leading run
(how many, or the payloads). The chain's usable length is the earliest position any owner is
missing, so one round trip of parallel calls answers the whole chain.

Failures are misses. Every call has a deadline (`timeout_s`, shared by the whole fan-out); a
store that times out, dies or raises is logged once, leaves the ring (its keys now route to the
others, where they miss until recomputed blocks are put again) and counts as holding nothing.
No store failure ever reaches the caller as an exception; `add_store` brings a store back.
Bad input (a hash outside 128 bits, a payload that is not bytes) does raise, before any call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from actors.engine.block_hash import BlockHash
from actors.prefix_cache.handles import PendingCall, StoreHandle, StoreMethod
from actors.prefix_cache.ring import DEFAULT_VNODES_PER_STORE, HashRing, StoreId
from actors.prefix_cache.stats import PrefixCacheStats
from actors.prefix_cache.store import check_block_hash

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0

_Args = tuple[object, ...]
_Handles = Mapping[StoreId, StoreHandle]


@dataclass(frozen=True)
class PoolStats:
    total: PrefixCacheStats  # sum over the stores that answered
    per_store: dict[StoreId, PrefixCacheStats]
    failed_store_ids: tuple[StoreId, ...]  # every store dropped so far (and not re-added)


class PendingPut:
    """A put in flight. Dropping it is fine (fire and forget); `wait` collects how many blocks
    the stores newly stored, counting a failed store as zero."""

    def __init__(self, pool: PrefixCachePool, calls: list[tuple[StoreId, PendingCall]]) -> None:
        self._pool = pool
        self._calls = calls
        self._num_stored: int | None = None

    def wait(self, timeout_s: float | None = None) -> int:
        if self._num_stored is None:
            deadline = time.monotonic() + (self._pool.timeout_s if timeout_s is None else timeout_s)
            results = self._pool._collect(self._calls, deadline)
            self._num_stored = sum(int(n) for n in results.values())  # type: ignore[call-overload]
        return self._num_stored


class PrefixCachePool:
    def __init__(
        self,
        stores: Mapping[StoreId, StoreHandle],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        vnodes_per_store: int = DEFAULT_VNODES_PER_STORE,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # guards membership; calls run outside it
        self._ring = HashRing(vnodes_per_store=vnodes_per_store)
        self._handles: dict[StoreId, StoreHandle] = {}
        self._failed: dict[StoreId, None] = {}  # insertion-ordered set
        for store_id, handle in stores.items():
            self.add_store(store_id, handle)

    # --- membership -------------------------------------------------------------------------

    @property
    def store_ids(self) -> list[StoreId]:
        with self._lock:
            return self._ring.store_ids

    @property
    def failed_store_ids(self) -> tuple[StoreId, ...]:
        with self._lock:
            return tuple(self._failed)

    def add_store(self, store_id: StoreId, handle: StoreHandle) -> None:
        with self._lock:
            self._ring.add(store_id)
            self._handles[store_id] = handle
            self._failed.pop(store_id, None)

    def remove_store(self, store_id: StoreId) -> bool:
        """Takes a store off the ring (its keys then route to the others); False if absent."""
        with self._lock:
            if store_id not in self._handles:
                return False
            self._ring.remove(store_id)
            del self._handles[store_id]
            return True

    def owner(self, block_hash: BlockHash) -> StoreId:
        with self._lock:
            return self._ring.owner(check_block_hash(block_hash))

    def _drop(self, store_id: StoreId, error: BaseException) -> None:
        if self.remove_store(store_id):  # only the first report of a failure gets logged
            with self._lock:
                self._failed[store_id] = None
            logger.warning(
                "prefix-cache store %s failed (%s: %s); it leaves the ring, its keys are misses",
                store_id, type(error).__name__, error,
            )

    # --- fan-out with one deadline --------------------------------------------------------

    def _route(self, hashes: Sequence[BlockHash]) -> tuple[dict[StoreId, list[int]], _Handles]:
        """Positions of `hashes` grouped by owner, and a snapshot of the owners' handles."""
        positions: dict[StoreId, list[int]] = {}
        with self._lock:
            if not self._handles:
                return {}, {}
            for i, h in enumerate(hashes):
                positions.setdefault(self._ring.owner(h), []).append(i)
            return positions, {s: self._handles[s] for s in positions}

    def _start(
        self, method: StoreMethod, args: Mapping[StoreId, _Args], handles: _Handles
    ) -> list[tuple[StoreId, PendingCall]]:
        started = []
        for store_id, store_args in args.items():
            try:
                started.append((store_id, handles[store_id].call(method, *store_args)))
            except Exception as e:  # a handle that cannot even start a call is a failed store
                self._drop(store_id, e)
        return started

    def _collect(self, calls: list[tuple[StoreId, PendingCall]], deadline: float) -> dict[StoreId, object]:
        """Results of the calls that finished in time; every other store is dropped."""
        results: dict[StoreId, object] = {}
        for store_id, pending in calls:
            try:
                results[store_id] = pending.result(max(0.0, deadline - time.monotonic()))
            except Exception as e:
                self._drop(store_id, e)
        return results

    def _fan_out(
        self, method: StoreMethod, args: Mapping[StoreId, _Args], handles: _Handles
    ) -> dict[StoreId, object]:
        deadline = time.monotonic() + self.timeout_s
        return self._collect(self._start(method, args, handles), deadline)

    # --- the API ----------------------------------------------------------------------------

    def match_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading hashes of the chain held by the pool (no payload moves, no LRU
        change). A later `get_prefix` may still return fewer: blocks can be evicted meanwhile."""
        hashes = [check_block_hash(h) for h in hashes]
        positions, handles = self._route(hashes)
        if not positions:  # no hashes, or no store left
            return 0
        args = {s: ([hashes[i] for i in pos],) for s, pos in positions.items()}
        results = self._fan_out("match_prefix", args, handles)
        usable = len(hashes)
        for store_id, pos in positions.items():
            num_leading = int(results.get(store_id, 0))  # type: ignore[call-overload]
            if num_leading < len(pos):
                usable = min(usable, pos[num_leading])
        return usable

    def get_prefix(self, hashes: Sequence[BlockHash]) -> list[bytes]:
        """Payloads of the chain's leading run, fetched from all owners in parallel. Owners stop
        at their own first miss, so little past the chain's first miss is ever sent."""
        hashes = [check_block_hash(h) for h in hashes]
        positions, handles = self._route(hashes)
        if not positions:
            return []
        args = {s: ([hashes[i] for i in pos],) for s, pos in positions.items()}
        results = self._fan_out("get_prefix", args, handles)
        by_position: dict[int, bytes] = {}
        usable = len(hashes)
        for store_id, pos in positions.items():
            payloads: list[bytes] = results.get(store_id, [])  # type: ignore[assignment]
            by_position.update(zip(pos, payloads))
            if len(payloads) < len(pos):
                usable = min(usable, pos[len(payloads)])
        return [by_position[i] for i in range(usable)]

    def put(self, blocks: Iterable[tuple[BlockHash, bytes]]) -> PendingPut:
        """Sends blocks to their owners and returns at once; the result is optional to collect."""
        checked: list[tuple[BlockHash, bytes]] = []
        for h, payload in blocks:
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                raise TypeError(f"a payload is bytes, got {type(payload).__name__}")
            checked.append((check_block_hash(h), bytes(payload)))
        positions, handles = self._route([h for h, _ in checked])
        args = {s: ([checked[i] for i in pos],) for s, pos in positions.items()}
        return PendingPut(self, self._start("put", args, handles))

    def stats(self) -> PoolStats:
        with self._lock:
            handles = dict(self._handles)
        results = self._fan_out("stats_dict", dict.fromkeys(handles, ()), handles)
        per_store = {s: PrefixCacheStats.from_dict(d) for s, d in results.items()}  # type: ignore[arg-type]
        return PoolStats(PrefixCacheStats.total(per_store.values()), per_store, self.failed_store_ids)
