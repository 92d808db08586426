"""A worker's uses of the prefix-cache pool: fetch the next blocks of a chain, offer new ones.

Mental model: the pool stores one KV block per chained hash as an opaque payload; here a payload is
a codec shard of exactly one block (all layers), carrying its hash in the header. `fetch` asks the
pool for the leading run of a hash chain and decodes it into one [L, 2, n, bs, Hkv, D] tensor,
stopping at the first payload that does not decode or names another hash (a miss, never an error).
Offers are encoded with the tenant's pool codec (`codec_for`: lossy ones only for tenants whose
KV fidelity is lossy), and an exact tenant's fetch takes only blocks a lossless codec stored.
`offer` runs in the background on one thread: it asks the pool how much of the chain it already
has and puts only the rest, so a popular prefix is sent once, not once per request. Offers beyond
`max_pending` are dropped: the cache is an optimisation and must never queue without bound.

Every put says whose blocks they are (the request's tenant: the pool shares its tiers by tenant)
and where in the chain they start. `prefetch` asks the pool to bring a queued request's chain
up from disk before `fetch` reads it; it never waits for the pool's answer.

`shadow` puts a running request's next blocks under its private shadow keys (no lookup first:
nobody else has them; marked as shadows, which the pool values low), tagged with the request's
epoch; `fetch(..., epoch=)` then accepts only blocks carrying it. `remove` drops a chain. Both
share the offers' one thread and bound.

`import_prefix` is the lookup before a prompt is computed, for any engine that prefills: the
prefill worker's, and a decode worker's when the scheduler has it prefill a request itself (it
fetches from the pool but does not offer). The pool turns store failures into misses within its
deadline; this module adds none of its own.

`fetch` also measures the link: the wall time of each fetch that returned blocks (the pool's
answer, decoding, the copy out) over the blocks it returned, smoothed over fetches
(`fetch_s_per_block`). The worker reports it, and the scheduler prices a pool hit on this worker
with it instead of a configured constant.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from actors.engine.async_engine import AsyncEngine
from actors.engine.block_hash import BlockHash
from actors.prefix_cache.pool import PrefixCachePool
from transfer.codec import Compression, KVLayout, decode_shard, encode
from transfer.transport import TransferError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolLinkStats:
    num_fetched_blocks: int
    num_offered_blocks: int  # handed to the pool (it already had the others)
    num_stored_blocks: int  # the pool reported as new
    num_dropped_offers: int  # not attempted: too many in flight
    num_pending_offers: int
    num_prefetches: int  # chains the pool was asked to bring up from disk
    num_timed_fetches: int = 0  # fetches that returned blocks: those `fetch_s_per_block` is measured on
    fetch_s_per_block: float | None = None  # smoothed wall seconds per fetched block; None before any


# Weight of the newest fetch in the smoothed seconds per block: the last five or so fetches carry
# most of it, so the estimate follows a pool that slows down (disk tier, a loaded store) within a
# few requests while one stray slow fetch moves it by a fifth. A fetch's fixed cost (the round trip)
# is spread over its blocks: a figure per block, as placement prices it.
FETCH_WEIGHT = 0.2


class PoolLink:
    def __init__(self, pool: PrefixCachePool, layout: KVLayout, codec_for: Callable[[str], str] = lambda tenant: "none",
                 max_pending: int = 64, clock: Callable[[], float] = time.perf_counter,
                 exact_for: Callable[[str], bool] = lambda tenant: True) -> None:
        self.pool = pool
        self.layout = layout
        self.codec_for = codec_for  # a tenant -> the codec its offered blocks are encoded with
        self.exact_for = exact_for  # a tenant -> whether it takes only bit-exact blocks from the pool
        self.max_pending = max_pending
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pool-offer")
        self._lock = threading.Lock()
        self._pending: set[Future[int]] = set()
        self._num_fetched = self._num_offered = self._num_stored = 0
        self._num_dropped = self._num_prefetches = 0
        self._clock = clock
        self._num_timed_fetches = 0
        self._fetch_s_per_block: float | None = None

    def fetch(self, hashes: Sequence[BlockHash], epoch: int | None = None,
              exact: bool = True) -> tuple[list[BlockHash], torch.Tensor | None]:
        """(hashes, KV [L, 2, n, bs, Hkv, D]) of the chain's leading run the pool holds: each block
        passed the codec's checksum and carries its own hash (and `epoch`, when given, as its
        transfer id), and with `exact` was stored with a lossless codec; the run ends at the first
        that does not. Blocking. A fetch that returns blocks updates `fetch_s_per_block`."""
        if not hashes:
            return [], None
        start = self._clock()
        kvs: list[torch.Tensor] = []
        for h, payload in zip(hashes, self.pool.get_prefix(hashes)):
            try:
                shard = decode_shard(payload, self.layout)
            except (TransferError, ValueError) as e:
                logger.warning("prefix pool block %032x does not decode (%s); treating it as a miss", h, e)
                break
            hdr = shard.header
            if hdr.block_hashes != (int(h),) or hdr.layers != range(self.layout.num_layers):
                logger.warning("prefix pool block %032x holds another block; treating it as a miss", h)
                break
            if exact and not Compression(hdr.compression).lossless:  # salted per tenant: only a shared salt gets here
                logger.warning("prefix pool block %032x is lossy (%s) and the tenant's KV is exact; treating it as a "
                               "miss", h, Compression(hdr.compression).name.lower())
                break
            if epoch is not None and hdr.transfer_id != epoch:
                logger.warning("prefix pool block %032x is from epoch %d, not %d (stale); treating it as a miss",
                               h, hdr.transfer_id, epoch)
                break
            kvs.append(shard.kv)
        # cat copies: the result no longer points into the payloads
        kv = torch.cat(kvs, dim=2) if kvs else None
        elapsed_s = self._clock() - start
        with self._lock:
            self._num_fetched += len(kvs)
            if kvs:  # a miss measures the pool's lookup, not what a block costs to bring over
                measured, last = elapsed_s / len(kvs), self._fetch_s_per_block
                self._fetch_s_per_block = measured if last is None else last + FETCH_WEIGHT * (measured - last)
                self._num_timed_fetches += 1
        return list(hashes[: len(kvs)]), kv

    @property
    def fetch_s_per_block(self) -> float | None:
        """Smoothed wall seconds per block of the fetches that returned blocks; None before any."""
        return self._fetch_s_per_block

    def prefetch(self, hashes: Sequence[BlockHash]) -> None:
        """Asks the pool to move the chain's leading run from disk to DRAM; does not wait."""
        if hashes:
            self.pool.prefetch(hashes)
            with self._lock:
                self._num_prefetches += 1

    def offer(self, hashes: Sequence[BlockHash], kv: torch.Tensor, tenant: str) -> bool:
        """Queues `tenant`'s full blocks `hashes` (a chain from its start; KV [L, 2, n, ...], a
        private copy) for the pool; False when dropped because too many offers are in flight."""
        assert kv.shape[2] == len(hashes)
        return not hashes or self._submit(self._offer, list(hashes), kv, tenant)

    def shadow(self, hashes: Sequence[BlockHash], kv: torch.Tensor, epoch: int, tenant: str) -> bool:
        """Queues the blocks `hashes` of a request's shadows (its chain's full blocks, or its partly
        filled last one; KV a private copy, always sent exact), each tagged with `epoch`, as
        `tenant`'s; False when dropped (too many in flight)."""
        assert kv.shape[2] == len(hashes)
        return not hashes or self._submit(self._put, list(hashes), kv, 0, "none", epoch, tenant, True)

    def remove(self, hashes: Sequence[BlockHash]) -> bool:
        """Queues dropping the blocks `hashes` from the pool; False when dropped."""
        return not hashes or self._submit(lambda: self.pool.remove(list(hashes)).wait())

    def _submit(self, fn: Callable[..., int], *args: object) -> bool:
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self._num_dropped += 1
                return False
            future = self._executor.submit(fn, *args)
            self._pending.add(future)
        future.add_done_callback(self._done)
        return True

    def _offer(self, hashes: list[BlockHash], kv: torch.Tensor, tenant: str) -> int:
        return self._put(hashes, kv, self.pool.match_prefix(hashes), self.codec_for(tenant), 0, tenant, False)

    def _put(self, hashes: list[BlockHash], kv: torch.Tensor, have: int, compression: str, epoch: int,
             tenant: str, shadow: bool) -> int:
        blocks = []
        for j in range(have, len(hashes)):
            (payload,) = encode(kv[:, :, j : j + 1], self.layout, compression=compression, num_shards=1,
                                block_hashes=[hashes[j]], transfer_id=epoch)
            blocks.append((hashes[j], bytes(payload)))
        stored = self.pool.put(blocks, tenant=tenant, first_depth=have, shadow=shadow).wait() if blocks else 0
        with self._lock:
            self._num_offered += len(blocks)
            self._num_stored += stored
        return stored

    def _done(self, future: Future[int]) -> None:
        with self._lock:
            self._pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            logger.warning("offering blocks to the prefix pool failed: %r", future.exception())

    def flush(self, timeout_s: float) -> bool:
        """Waits for the offers in flight; True if all finished in time."""
        with self._lock:
            pending = set(self._pending)
        _, not_done = wait(pending, timeout=timeout_s)
        return not not_done

    def stats(self) -> PoolLinkStats:
        with self._lock:
            return PoolLinkStats(self._num_fetched, self._num_offered, self._num_stored, self._num_dropped,
                                 len(self._pending), self._num_prefetches, self._num_timed_fetches,
                                 self._fetch_s_per_block)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def import_prefix(async_engine: AsyncEngine, pool: PoolLink | None, reusable: Sequence[BlockHash],
                  tenant: str = "") -> tuple[int, int]:
    """Before a prompt is computed: (leading blocks of `reusable` the engine's own prefix cache
    holds, blocks fetched from the pool after those and imported into it, charged to `tenant`), so
    the engine's prefill reuses both like its own. Blocking (the engine lock, the pool). Imports 0
    when the engine has no free block to put them in: they are then simply recomputed."""
    engine = async_engine.engine
    num_local = async_engine.locked(engine.cached_prefix_len, reusable)
    if pool is None or num_local >= len(reusable):
        return num_local, 0
    got, kv = pool.fetch(reusable[num_local:], exact=pool.exact_for(tenant))
    if kv is None:
        return num_local, 0
    return num_local, async_engine.locked(engine.import_cached_blocks, got, kv, tenant)
