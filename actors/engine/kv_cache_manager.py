"""Maps requests to KV blocks: prefix lookup, slot allocation, caching of full blocks, freeing.

A request's blocks are `blocks[req_id]`, in token order; token at position p lives in slot
`blocks[p // block_size].block_id * block_size + p % block_size`. Prefix reuse: the chained hashes
of a request's full prompt blocks are looked up in the pool until the first miss; those blocks are
shared (refcount +1) and their tokens are not computed again.

Tenant ceilings: with `TenantShares`, an allocation that would take the request's tenant past its
`max` share of the blocks is refused like one the pool cannot hold (`allocate_slots` returns False;
`over_share` tells the two apart), so the tenant waits for its own blocks instead of taking others'.

Paging (paging.py): which free blocks a request's new tokens get is the `PagingPolicy`'s choice (lazy:
the free queue's order; request-aware: contiguous runs held ahead for long requests); what is shared
and cached, and under which hashes, is the same under every policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from actors.engine.block_hash import BlockHash
from actors.engine.block_pool import Block, BlockPool
from actors.engine.paging import Pager, PagingPolicy
from actors.engine.request import Request
from actors.engine.shares import TenantShares


@dataclass(frozen=True)
class PrefixHitStats:
    num_queried_tokens: int
    num_hit_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 shares: TenantShares | None = None, paging: PagingPolicy | None = None) -> None:
        self.block_size = block_size
        self.shares = shares or TenantShares()
        paging = paging or PagingPolicy()
        self.pool = BlockPool(num_blocks, enable_caching, self.shares, hard_holds=paging.hard_holds)
        self.pager = Pager(self.pool, paging, block_size)
        self.enable_caching = enable_caching
        self._blocks: dict[str, list[Block]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks of a request registered in the pool
        self._queried_tokens = 0
        self._hit_tokens = 0

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of the request, as (blocks, num_tokens). At least one token is
        always left to compute: the engine needs the last position's logits."""
        if not self.enable_caching:
            return [], 0
        hits: list[Block] = []
        for block_hash in request.block_hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        self._queried_tokens += request.num_tokens
        self._hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[Block] | None = None
    ) -> bool:
        """Makes room for `num_new_tokens` after the request's computed tokens (plus, on first
        admission, its cached `computed_blocks`). Returns False, changing nothing, when the pool
        cannot hold them."""
        computed_blocks = computed_blocks or []
        num_new_blocks, num_revived = self._new_blocks(request, num_new_tokens, computed_blocks)
        # Cached blocks we are about to revive are counted in the free queue: don't count them twice.
        available = self.pool.num_free_blocks + self.pager.num_own_held(request.request_id)
        if num_new_blocks > available - num_revived:
            return False
        if self.over_share(request, num_new_tokens, computed_blocks):
            return False
        held = self._blocks.get(request.request_id, [])
        if computed_blocks:
            assert not held, "cached prefix blocks are only taken at first admission"
            self.pool.touch(computed_blocks)
            held = list(computed_blocks)
            self._num_cached[request.request_id] = len(computed_blocks)
        self._blocks[request.request_id] = held + self.pager.allocate(request, held, num_new_blocks)
        return True

    def _new_blocks(self, request: Request, num_new_tokens: int, computed_blocks: list[Block]) -> tuple[int, int]:
        """(blocks to allocate, cached blocks to revive) for `num_new_tokens` more of `request`."""
        held = self._blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_needed - len(held) - len(computed_blocks))
        return num_new_blocks, sum(1 for b in computed_blocks if b.ref_cnt == 0)

    def over_share(self, request: Request, num_new_tokens: int, computed_blocks: list[Block] | None = None) -> bool:
        """Whether `num_new_tokens` more would take the request's tenant past its `max` share."""
        if not self.shares.enabled:
            return False
        new, revived = self._new_blocks(request, num_new_tokens, computed_blocks or [])
        used = self.pool.in_use.get(request.tenant, 0)
        return new + revived > 0 and self.shares.over_limit(request.tenant, used, new + revived, self.pool.num_blocks)

    def above_guarantee(self, tenant: str) -> bool:
        """Whether `tenant` holds more blocks in use than its guaranteed share."""
        return self.pool.in_use.get(tenant, 0) > self.shares.guarantee(tenant, self.pool.num_blocks)

    def below_guarantee(self, tenant: str) -> bool:
        """Whether shares are on and `tenant` holds fewer blocks in use than its guarantee."""
        return self.shares.enabled and self.pool.in_use.get(tenant, 0) < self.shares.guarantee(
            tenant, self.pool.num_blocks)

    def num_held_blocks(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def cache_computed_blocks(self, request: Request) -> None:
        """Registers the request's full blocks whose KV is now computed under their hashes."""
        if not self.enable_caching:
            return
        blocks = self._blocks[request.request_id]
        done = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached.get(request.request_id, 0)
        for i in range(start, done):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached[request.request_id] = max(start, done)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Frees the request's trailing blocks past the first `num_tokens` tokens (slots taken for
        speculative tokens that were rejected); returns how many. Only uncached blocks are trimmed:
        a block is cached once all its tokens are computed, and those lie before `num_tokens`."""
        blocks = self._blocks.get(request.request_id, [])
        keep = self.num_blocks_needed(num_tokens)
        if len(blocks) <= keep:
            return 0
        assert keep >= self._num_cached.get(request.request_id, 0), "a cached block would be trimmed"
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free(reversed(tail))
        self.pager.on_trim(request, tail)
        return len(tail)

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free(reversed(blocks))
        self.pager.release(request.request_id)

    def cached_prefix_len(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a hash chain the pool holds as cached prefixes."""
        n = 0
        for h in block_hashes:
            if self.pool.get_cached_block(h) is None:
                break
            n += 1
        return n

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prefix_stats(self) -> PrefixHitStats:
        return PrefixHitStats(self._queried_tokens, self._hit_tokens)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.pager.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self._blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (block, refs.get(block.block_id))
