"""Request-aware paging: which free blocks a request's new KV goes to, by its expected length.

Mental model: the pool's blocks are one row of pages. A request's expected length is its prompt plus
`max_tokens` (the most it can grow to). Short requests (expected < `long_tokens`) take the blocks lazy
paging would give them, from the free queue's front (recently freed empty blocks, then the least
recently used prefixes): they pack into the holes other requests leave; only their order in the
table changes (ascending ids: the LRU hands a freed request's blocks out tail first, descending).
A long request takes its blocks in runs: a contiguous range of free block ids, right after its last
block when that range qualifies, else the highest qualifying one (away from the low ids the free
queue starts with); it takes what it needs now and *holds* the empty blocks after them, up to
`run_blocks` (`BlockPool.hold`), for its next tokens, so its table is a few contiguous runs that a
decode kernel reads as long streams. A hold is soft by default: held blocks still count as free, and
any allocation takes one once the other empty blocks are gone (before a cached prefix is evicted), so
admission, preemption and concurrency are the lazy policy's; with `hard_holds`, held blocks are
reserved (withheld from everybody else until the request ends), which costs concurrency.

Block hashes and prefix sharing do not depend on the policy: a request's cached prefix blocks are
looked up and shared as before; only the blocks of its new tokens are chosen here, and a block is
registered under its chained hash when its tokens are computed, whichever block id it has. Eviction
does not either: a range qualifies only if the cached prefixes it holds are among those lazy paging
would evict for the same allocation (`_find_range`), and a held block is always empty; when no range
qualifies, the request gets lazy paging's blocks, in id order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from actors.engine.block_pool import FREE, FREE_CACHED, HELD, Block, BlockPool
from actors.engine.request import Request

PAGING_MODES = ("lazy", "request_aware")
# A run may evict, beyond the prefixes lazy paging would, this oldest fraction of the cached ones.
# 0: evicting out of LRU order took the recently freed KV of preempted requests (bench/paging.py,
# Azure trace, 300 requests: a slack of 0.25 recomputed 1.4x the tokens lazy paging did).
LRU_SLACK = 0.0


@dataclass(frozen=True)
class PagingPolicy:
    mode: str = "lazy"  # "lazy": every request takes blocks from the free queue (ferry's default)
    long_tokens: int = 1024  # prompt + max_tokens at or above this: a long request (runs)
    run_blocks: int = 32  # blocks a long request holds ahead of what it needs now, per run
    hard_holds: bool = False  # held blocks are reserved for their request (False: lent when needed)

    def __post_init__(self) -> None:
        if self.mode not in PAGING_MODES:
            raise ValueError(f"kv paging mode must be one of {PAGING_MODES}, got {self.mode!r}")
        if self.long_tokens < 1 or self.run_blocks < 1:
            raise ValueError(f"kv paging long_tokens and run_blocks must be >= 1, got "
                             f"{self.long_tokens} and {self.run_blocks}")

    @property
    def request_aware(self) -> bool:
        return self.mode == "request_aware"


@dataclass(frozen=True)
class PagingStats:
    num_held_blocks: int  # free blocks held ahead for long requests' runs
    num_runs: int  # runs started (contiguous ranges found)
    num_run_misses: int  # long-request allocations that found no free range and went scattered
    num_broken_holds: int  # held blocks another request took before their owner reached them


class Pager:
    """Picks the blocks of each allocation for a `KVCacheManager` (see the module docstring)."""

    def __init__(self, pool: BlockPool, policy: PagingPolicy, block_size: int) -> None:
        self.pool = pool
        self.policy = policy
        self.block_size = block_size
        self._plans: dict[str, deque[int]] = {}  # long request -> block ids it holds ahead, in order
        # block id -> the request it was held for (stale once another allocation took the block)
        self._holder: dict[int, str] = {}
        self.num_runs = 0
        self.num_run_misses = 0
        self.num_broken_holds = 0

    def expected_blocks(self, request: Request) -> int:
        return -(-(request.num_prompt_tokens + request.params.max_tokens) // self.block_size)

    def is_long(self, request: Request) -> bool:
        return self.policy.request_aware and (
            request.num_prompt_tokens + request.params.max_tokens >= self.policy.long_tokens)

    def num_own_held(self, request_id: str) -> int:
        """Blocks held for this request that only it may take (hard holds); 0 with soft ones, which
        count as free for everybody already."""
        if not self.pool.hard_holds:
            return 0
        return sum(1 for i in self._plans.get(request_id, ()) if self._held_for(request_id, i))

    def _held_for(self, request_id: str, block_id: int) -> bool:
        return self.pool.free_state[block_id] == HELD and self._holder.get(block_id) == request_id

    def _usable_by(self, request_id: str, block_id: int) -> bool:
        """A planned block is still the owner's: held for it, or lent and given back empty (a block
        that came back holding a prefix is not taken: that prefix may have just been used)."""
        return self.pool.free_state[block_id] == FREE or self._held_for(request_id, block_id)

    def allocate(self, request: Request, held: list[Block], num_blocks: int) -> list[Block]:
        """`num_blocks` new blocks for `request`, which already has `held` (its table so far); the
        caller checked that the pool can spare them."""
        if num_blocks == 0:
            return []
        if not self.policy.request_aware:
            return self.pool.allocate(num_blocks, request.tenant)
        if not self.is_long(request):
            return self._in_id_order(num_blocks, request)
        out: list[Block] = []
        rid = request.request_id
        plan = self._plans.setdefault(rid, deque())
        while len(out) < num_blocks:
            if plan:
                block_id = plan.popleft()
                usable = self._usable_by(rid, block_id)
                if self._holder.get(block_id) == rid:
                    del self._holder[block_id]
                if usable:
                    out += self.pool.take([block_id], request.tenant)
                    continue
                self.num_broken_holds += 1
                self._release(rid, plan)  # the run was broken into: start a new one
            last = out[-1] if out else (held[-1] if held else None)
            run = self._start_run(request, plan, last, num_blocks - len(out), len(held) + len(out))
            if run is None:
                self.num_run_misses += 1
                run = self._in_id_order(num_blocks - len(out), request)
            out += run
        return out

    def _in_id_order(self, num_blocks: int, request: Request) -> list[Block]:
        """The blocks lazy paging would give, in ascending id order: the LRU hands a freed request's
        blocks out tail first (descending ids), so sorted they form ascending runs, at no cost."""
        return sorted(self.pool.allocate(num_blocks, request.tenant), key=lambda b: b.block_id)

    def _start_run(self, request: Request, plan: deque[int], last: Block | None, need: int,
                   num_held: int) -> list[Block] | None:
        """Takes a free range of `need` blocks followed by up to `run_blocks` more (never past the
        request's expected end), which it holds ahead in `plan`; a range of just `need` when no
        longer one is free; None when there is none either."""
        ahead = min(self.policy.run_blocks, max(0, self.expected_blocks(request) - num_held - need))
        for size in dict.fromkeys((need + ahead, need)):
            start = self._find_range(size, need, None if last is None else last.block_id + 1)
            if start is not None:
                # Ahead, only the empty blocks up to the first cached one are held: a cached prefix is
                # evicted only when taken, and by then it may be one that was just used again.
                ahead_ids = []
                for i in range(start + need, start + size):
                    if self.pool.free_state[i] != FREE:
                        break
                    ahead_ids.append(i)
                plan.extend(ahead_ids)
                self._hold(request.request_id, ahead_ids)
                self.num_runs += 1
                return self.pool.take(range(start, start + need), request.tenant)
        return None

    def _find_range(self, size: int, need: int, after: int | None) -> int | None:
        """Start of `size` contiguous free, unheld block ids whose cached prefixes (if any) are all
        among those lazy paging would evict for `need` blocks (plus `LRU_SLACK`): at `after` when that
        range qualifies and its youngest prefix is no younger than the best range's, else the range
        whose youngest prefix is oldest, the highest of those; None when none qualifies."""
        state = np.frombuffer(self.pool.free_state, dtype=np.uint8)
        if size > len(state):
            return None
        usable = (state == FREE) | (state == FREE_CACHED)
        counts = np.concatenate(([0], np.cumsum(usable)))
        fits = np.flatnonzero(counts[size:] - counts[:-size] == size)
        if not len(fits):
            return None
        if not (state == FREE_CACHED).any():
            youngest = np.zeros(len(fits), dtype=np.int64)  # no cached prefix anywhere: no ranks needed
        else:
            cached = self.pool.cached_free_ids()
            ranks = np.zeros(len(state) + 1, dtype=np.int64)  # 0: empty (or not free: no fit has one)
            ranks[cached] = np.arange(1, len(cached) + 1)  # k: the k-th prefix lazy paging would evict
            # the prefixes lazy paging would evict for `need` blocks (after the empty ones), plus the slack
            limit = max(0, need - int((state == FREE).sum())) + int(LRU_SLACK * len(cached))
            bounds = np.stack((fits, fits + size), axis=1).ravel()
            youngest = np.maximum.reduceat(ranks, bounds)[::2]  # the max rank in each fitting range
            keep = youngest <= limit
            fits, youngest = fits[keep], youngest[keep]
            if not len(fits):
                return None
        best = youngest.min()
        if after is not None:
            at = np.flatnonzero(fits == after)
            if len(at) and youngest[at[0]] <= best:
                return after
        return int(fits[youngest == best][-1])

    def on_trim(self, request: Request, freed: list[Block]) -> None:
        """A long request's trailing blocks were freed (rejected speculative slots): they head its
        plan again, held, so its next tokens land where they were."""
        if not self.is_long(request) or not freed:
            return
        ids = [b.block_id for b in freed if self.pool.free_state[b.block_id] == FREE]
        self._hold(request.request_id, ids)
        self._plans.setdefault(request.request_id, deque()).extendleft(reversed(ids))

    def _hold(self, request_id: str, block_ids: list[int]) -> None:
        self.pool.hold(block_ids)
        self._holder.update(dict.fromkeys(block_ids, request_id))

    def release(self, request_id: str) -> None:
        """The request's held blocks go back to the free queue (it finished or was preempted)."""
        plan = self._plans.pop(request_id, None)
        if plan:
            self._release(request_id, plan)

    def _release(self, request_id: str, plan: deque[int]) -> None:
        mine = [i for i in plan if self._holder.get(i) == request_id]
        self.pool.unhold(i for i in mine if self.pool.free_state[i] == HELD)
        for i in mine:
            del self._holder[i]
        plan.clear()

    def stats(self) -> PagingStats:
        return PagingStats(self.pool.num_held_blocks, self.num_runs, self.num_run_misses, self.num_broken_holds)

    def check_integrity(self) -> None:
        held = {i for i, s in enumerate(self.pool.free_state) if s == HELD}
        assert held <= self._holder.keys(), "a held block without a holder"
        for i in held:
            assert i in self._plans.get(self._holder[i], ()), f"held block {i} is not in its holder's plan"
