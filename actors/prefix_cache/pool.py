"""The client side of the prefix-cache pool: N stores, each block on the store the ring picks.

Mental model: a prefix is a chain of block hashes, and the chain is only useful up to its first
missing block. Each hash is routed to its owner (consistent hashing, `ring.py`); a lookup sends
every owner its share of the chain at once, and each owner answers for its share's leading run
(how many, or the payloads). The chain's usable length is the earliest position any owner is
missing, so one round trip of parallel calls answers the whole chain. A put says whose blocks
they are and their depth in the chain; each store applies the tenant shares to its own tiers,
which the ring's even spread makes the pool's. `prefetch` is a lookup's fire-and-forget twin: the
owners move their part of the chain from disk to DRAM before the request comes to read it.

Failures are misses. Every call has a deadline (`timeout_s`, shared by the whole fan-out); a
store that times out, dies or raises is logged once, leaves the ring (its keys now route to the
others, where they miss until recomputed blocks are put again) and counts as holding nothing.
No store failure ever reaches the caller as an exception. A dropped store is probed again
(`stats_dict`) `retry_s` later, then at doubling intervals up to `MAX_RETRY_S`: a store that was
only slow, or that Ray restarted (its actor restarts, and comes back empty), rejoins the ring
once it answers. Probes never wait: each pool call looks at the probe started by an earlier one.
`add_store` brings a store back by hand.
Bad input (a hash outside 128 bits, a payload that is not bytes) does raise, before any call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from actors.engine.block_hash import BlockHash
from actors.holdings import HoldingsRead
from actors.prefix_cache.handles import PendingCall, StoreHandle, StoreMethod, StoreTimeout
from actors.prefix_cache.ring import DEFAULT_VNODES_PER_STORE, HashRing, StoreId
from actors.prefix_cache.stats import PrefixCacheStats, TenantUse
from actors.prefix_cache.config import DEFAULT_TENANT, check_block_hash

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
DEFAULT_RETRY_S = 5.0  # first probe of a dropped store
MAX_RETRY_S = 60.0
DROPPED = "dropped"  # the incarnation a store out of the ring reports its (empty) holdings under

_Args = tuple[object, ...]
_Handles = Mapping[StoreId, StoreHandle]


@dataclass(frozen=True)
class PoolStats:
    total: PrefixCacheStats  # sum over the stores that answered
    per_store: dict[StoreId, PrefixCacheStats]
    failed_store_ids: tuple[StoreId, ...]  # every store dropped so far (and not re-added)


class PendingPut:
    """A put (or remove, or prefetch) in flight. Dropping it is fine (fire and forget); `wait`
    collects how many blocks the stores newly stored (removed, moved up), a failed store as zero."""

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


@dataclass
class _Dropped:
    """A store out of the ring, and when and how it is probed again."""

    handle: StoreHandle
    probe_at: float  # monotonic
    num_failures: int = 1
    probe: PendingCall | None = None


class PrefixCachePool:
    def __init__(
        self,
        stores: Mapping[StoreId, StoreHandle],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        vnodes_per_store: int = DEFAULT_VNODES_PER_STORE,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        if timeout_s <= 0 or retry_s < 0:
            raise ValueError(f"timeout_s must be positive and retry_s >= 0, got {timeout_s}, {retry_s}")
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._lock = threading.Lock()  # guards membership; calls run outside it
        self._ring = HashRing(vnodes_per_store=vnodes_per_store)
        self._handles: dict[StoreId, StoreHandle] = {}
        self._failed: dict[StoreId, _Dropped] = {}  # in the order they were dropped
        self._strikes: dict[StoreId, int] = {}  # times each store was dropped
        self._healing = threading.Lock()
        self.num_rejoined = 0
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

    def owner(self, block_hash: BlockHash) -> StoreId:
        with self._lock:
            return self._ring.owner(check_block_hash(block_hash))

    def _drop(self, store_id: StoreId, error: BaseException) -> None:
        with self._lock:
            handle = self._handles.pop(store_id, None)
            if handle is None:  # only the first report of a failure counts
                return
            self._ring.remove(store_id)
            # A store that fails again after rejoining waits longer each time (it may answer a
            # probe yet time out on real work).
            strikes = self._strikes[store_id] = self._strikes.get(store_id, 0) + 1
            wait_s = self._wait_s(strikes)
            self._failed[store_id] = _Dropped(handle, time.monotonic() + wait_s, strikes)
        logger.warning("prefix-cache store %s failed (%s: %s); it leaves the ring, its keys are misses; "
                       "probed again in %g s", store_id, type(error).__name__, error, wait_s)

    def _heal(self) -> None:
        """Looks at the probes of dropped stores (never waits): a store that answered rejoins the
        ring; one that failed again is probed later; one whose time has come gets a probe."""
        if not self._failed or not self._healing.acquire(blocking=False):
            return  # nothing dropped, or another thread is looking right now
        try:
            self._heal_due(time.monotonic())
        finally:
            self._healing.release()

    def _heal_due(self, now: float) -> None:
        with self._lock:
            due = [(s, d) for s, d in self._failed.items() if d.probe is not None or d.probe_at <= now]
        for store_id, dropped in due:
            if dropped.probe is None:
                try:
                    dropped.probe = dropped.handle.call("stats_dict")
                except Exception:  # noqa: BLE001 - cannot even start a call: try later
                    self._probe_failed(dropped, now)
                    continue
            try:
                dropped.probe.result(0.0)
            except StoreTimeout:
                continue  # not answered yet; looked at again by the next call
            except Exception:  # noqa: BLE001 - still gone (or broken): try later
                self._probe_failed(dropped, now)
                continue
            with self._lock:
                if self._failed.get(store_id) is not dropped:
                    continue  # re-added (or dropped again) meanwhile
            self.add_store(store_id, dropped.handle)
            self.num_rejoined += 1
            logger.warning("prefix-cache store %s answers again; back on the ring (empty if it restarted)", store_id)

    def _probe_failed(self, dropped: _Dropped, now: float) -> None:
        dropped.num_failures += 1
        dropped.probe = None
        dropped.probe_at = now + self._wait_s(dropped.num_failures)

    def _wait_s(self, num_failures: int) -> float:
        """Before the next probe after `num_failures` failures: `retry_s`, doubling, at most `MAX_RETRY_S`."""
        return min(MAX_RETRY_S, self.retry_s * 2 ** (num_failures - 1))

    # --- fan-out with one deadline --------------------------------------------------------

    def _route(self, hashes: Sequence[BlockHash]) -> tuple[dict[StoreId, list[int]], _Handles]:
        """Positions of `hashes` grouped by owner, and a snapshot of the owners' handles."""
        self._heal()
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

    def put(self, blocks: Iterable[tuple[BlockHash, bytes]], *, tenant: str = DEFAULT_TENANT, first_depth: int = 0,
            shadow: bool = False) -> PendingPut:
        """Sends `tenant`'s blocks to their owners and returns at once; the result is optional to
        collect. The blocks are consecutive in their chain from position `first_depth`; `shadow`:
        a request's private KV shadows (kept at a low value)."""
        checked: list[tuple[BlockHash, bytes]] = []
        for h, payload in blocks:
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                raise TypeError(f"a payload is bytes, got {type(payload).__name__}")
            checked.append((check_block_hash(h), bytes(payload)))
        positions, handles = self._route([h for h, _ in checked])
        args = {s: ([checked[i] for i in pos], tenant, [first_depth + i for i in pos], shadow)
                for s, pos in positions.items()}
        return PendingPut(self, self._start("put", args, handles))

    def prefetch(self, hashes: Sequence[BlockHash]) -> PendingPut:
        """Asks each owner to move its part of the chain's leading run from disk to DRAM, for a
        request that will read it soon; returns at once (`wait` collects how many moved)."""
        hashes = [check_block_hash(h) for h in hashes]
        positions, handles = self._route(hashes)
        args = {s: ([hashes[i] for i in pos],) for s, pos in positions.items()}
        return PendingPut(self, self._start("prefetch", args, handles))

    def remove(self, hashes: Sequence[BlockHash]) -> PendingPut:
        """Drops blocks from their owners (a request's KV shadows once it ended) and returns at
        once; `wait` collects how many were there."""
        hashes = [check_block_hash(h) for h in hashes]
        positions, handles = self._route(hashes)
        args = {s: ([hashes[i] for i in pos],) for s, pos in positions.items()}
        return PendingPut(self, self._start("remove", args, handles))

    def stats(self) -> PoolStats:
        self._heal()
        with self._lock:
            handles = dict(self._handles)
        results = self._fan_out("stats_dict", dict.fromkeys(handles, ()), handles)
        per_store = {s: PrefixCacheStats.from_dict(d) for s, d in results.items()}  # type: ignore[arg-type]
        return PoolStats(PrefixCacheStats.total(per_store.values()), per_store, self.failed_store_ids)

    def holdings(self, cursors: Mapping[StoreId, tuple[str, int] | None]) -> dict[StoreId, HoldingsRead]:
        """Per store, the prefix blocks it holds after the reader's cursor ((incarnation, change
        number), or None for the whole set): see `PrefixCacheStore.holdings`. A store out of the
        ring (dropped, and not back yet) holds nothing a lookup can reach, so it reads as an empty
        whole set of the incarnation `DROPPED`, each time the same; one that does not answer now
        is left out this time."""
        self._heal()
        with self._lock:
            handles = dict(self._handles)
            dropped = [s for s in self._failed if s not in handles]
        args = {s: tuple(cursors.get(s) or (None, 0)) for s in handles}
        out: dict[StoreId, HoldingsRead] = {}
        for store_id, r in self._fan_out("holdings", args, handles).items():
            d: dict[str, Any] = r  # type: ignore[assignment]
            out[store_id] = HoldingsRead(d["incarnation"], d["seq"],
                                         tuple((n, tuple(a), tuple(rm)) for n, a, rm in d["changes"]),
                                         None if d["full"] is None else frozenset(d["full"]))
        for store_id in dropped:
            out[store_id] = HoldingsRead(DROPPED, 0, full=frozenset())
        return out

    def tenant_usage(self) -> dict[str, TenantUse]:
        """Bytes each tenant holds per tier, summed over the stores that answered."""
        self._heal()
        with self._lock:
            handles = dict(self._handles)
        results = self._fan_out("tenant_usage", dict.fromkeys(handles, ()), handles)
        return TenantUse.total_by_tenant(results.values())  # type: ignore[arg-type]
