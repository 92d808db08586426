"""Request-aware paging: which free blocks a request's new KV goes to, by its expected length.

Mental model: the pool's blocks are one row of pages. A request's expected length is its prompt plus
`max_tokens` (the most it can grow to). Short requests (expected < `long_tokens`) take blocks the
plain way, from the free queue's front (recently freed empty blocks first): they pack into the holes
other requests leave. A long request takes its blocks in runs: a contiguous range of free block ids,
right after its last block when that range is free, else the range with the fewest cached prefixes,
the highest one among those (away from the low ids the free queue starts with); it takes what it
needs now and *holds* the rest of the run (`BlockPool.hold`) for its next tokens, so its block table
is a few contiguous runs that a decode kernel reads as long streams. A hold is soft by default: the
held blocks still count as free, and any allocation takes one once the other empty blocks are gone
(before a cached prefix is evicted), so admission and concurrency are the lazy policy's; with
`hard_holds`, held blocks are reserved (withheld from everybody else until the request ends).

Block hashes and prefix sharing do not depend on the policy: a request's cached prefix blocks are
looked up and shared as before; only the blocks of its new tokens are chosen here, and a block is
registered under its chained hash when its tokens are computed, whichever block id it has. A run may
take a free block that still holds a cached prefix (evicting it out of LRU order); it prefers ranges
without any.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from actors.engine.block_pool import FREE, FREE_CACHED, HELD, Block, BlockPool
from actors.engine.request import Request

PAGING_MODES = ("lazy", "request_aware")


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
        return self.pool.free_state[block_id] in (FREE, FREE_CACHED) or self._held_for(request_id, block_id)

    def allocate(self, request: Request, held: list[Block], num_blocks: int) -> list[Block]:
        """`num_blocks` new blocks for `request`, which already has `held` (its table so far); the
        caller checked that the pool can spare them."""
        if num_blocks == 0:
            return []
        if not self.is_long(request):
            return self.pool.allocate(num_blocks, request.tenant)
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
            if not self._plan_run(request, plan, last, num_blocks - len(out), len(held) + len(out)):
                self.num_run_misses += 1
                out += self.pool.allocate(num_blocks - len(out), request.tenant)
        return out

    def _plan_run(self, request: Request, plan: deque[int], last: Block | None, need: int, num_held: int) -> bool:
        """Fills `plan` with a free range of `need` blocks plus up to `run_blocks` ahead (never past
        the request's expected end), holding its empty blocks; a range of just `need` when no longer
        one is free; False when there is none either."""
        ahead = min(self.policy.run_blocks, max(0, self.expected_blocks(request) - num_held - need))
        for size in dict.fromkeys((need + ahead, need)):
            start = self._find_range(size, None if last is None else last.block_id + 1)
            if start is not None:
                ids = range(start, start + size)
                plan.extend(ids)
                self._hold(request.request_id, [i for i in ids if self.pool.free_state[i] == FREE])
                self.num_runs += 1
                return True
        return False

    def _find_range(self, size: int, after: int | None) -> int | None:
        """Start of `size` contiguous free, unheld block ids: at `after` when that range is free, else
        the one with the fewest cached prefixes, the highest of those; None when there is none."""
        state = np.frombuffer(self.pool.free_state, dtype=np.uint8)
        if size > len(state):
            return None
        if after is not None and after + size <= len(state):
            window = state[after:after + size]
            if ((window == FREE) | (window == FREE_CACHED)).all():
                return after
        usable = np.concatenate(([0], np.cumsum((state == FREE) | (state == FREE_CACHED))))
        cached = np.concatenate(([0], np.cumsum(state == FREE_CACHED)))
        fits = np.flatnonzero(usable[size:] - usable[:-size] == size)
        if not len(fits):
            return None
        cost = (cached[size:] - cached[:-size])[fits]
        best = fits[cost == cost.min()]
        return int(best[-1])

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
