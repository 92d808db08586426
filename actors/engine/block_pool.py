"""The paged KV block pool: fixed-size blocks, refcounts, an LRU free queue and a prefix index.

Every block is either in use (ref_cnt > 0) or in the free queue. A free block may still hold a
cached prefix (it has a `block_hash` and sits in `_cached`): it can be revived by a later request
with the same prefix (`touch`) until `allocate` evicts it. The free queue is ordered for eviction:
blocks with no cached content sit at the front (reused first), cached ones are appended at the back
in the order they were freed, so the least recently used prefix is evicted first.

Tenants: every block is charged to the tenant whose request allocated it (`Block.tenant`), so the
pool knows each tenant's footprint (`usage`: blocks in use plus free-but-cached). With
`TenantShares` set, a cached block is evicted from the tenant furthest above its guarantee first
(its least recently used one), not from the global LRU; the ceilings are enforced by the KV cache
manager, which refuses an allocation that would take a tenant past its `max`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from actors.engine.block_hash import BlockHash
from actors.engine.errors import EngineError
from actors.engine.shares import TenantShares


class OutOfBlocks(EngineError):
    """More blocks were asked for than the free queue holds (callers check `can_allocate`)."""


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    tenant: str = ""  # whose request allocated it (its KV), charged for it while in use or cached


@dataclass(frozen=True)
class BlockPoolStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_evictions: int


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, shares: TenantShares | None = None) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.shares = shares or TenantShares()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self.num_evictions = 0
        self.in_use: dict[str, int] = {}  # tenant -> its blocks with references
        # tenant -> its free blocks that hold a cached prefix, least recently used first
        self._cached_free: dict[str, OrderedDict[int, Block]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free queue in eviction order (front first)."""
        return list(self._free)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def usage(self) -> dict[str, int]:
        """Blocks charged to each tenant: in use, plus free ones still holding its cached prefixes."""
        out = dict(self.in_use)  # copies in one C call: safe to read from another thread (load polls)
        for tenant, blocks in list(self._cached_free.items()):
            out[tenant] = out.get(tenant, 0) + len(blocks)
        return {t: n for t, n in out.items() if n}

    def touch(self, blocks: Iterable[Block]) -> None:
        """Takes a reference on cached blocks found by hash, reviving them from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                self._unlist_cached_free(block)
                self.in_use[block.tenant] = self.in_use.get(block.tenant, 0) + 1
            block.ref_cnt += 1

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int, tenant: str = "") -> list[Block]:
        if num_blocks > len(self._free):
            raise OutOfBlocks(f"asked for {num_blocks} blocks, {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            block = self._next_victim()
            del self._free[block.block_id]
            if block.block_hash is not None:
                self._unlist_cached_free(block)
                self._evict(block)
            block.ref_cnt = 1
            block.tenant = tenant
            out.append(block)
        self.in_use[tenant] = self.in_use.get(tenant, 0) + num_blocks
        return out

    def _next_victim(self) -> Block:
        """The free block to hand out next: an empty one, else a cached one, from the global LRU or,
        with tenant shares, the LRU of the tenant furthest above its guarantee."""
        block = next(iter(self._free.values()))
        if block.block_hash is None or not self.shares.enabled:
            return block
        candidates = [t for t, blocks in self._cached_free.items() if blocks]
        tenant = self.shares.eviction_order(self.usage(), self.num_blocks, candidates)[0]
        return next(iter(self._cached_free[tenant].values()))

    def _unlist_cached_free(self, block: Block) -> None:
        if block.block_hash is not None:
            listed = self._cached_free.get(block.tenant)
            if listed is not None:
                listed.pop(block.block_id, None)

    def free(self, blocks: Iterable[Block]) -> None:
        """Drops one reference per block; callers pass a sequence's blocks tail first so that a
        prefix's last blocks are evicted before its first ones."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.in_use[block.tenant] -= 1
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self._cached_free.setdefault(block.tenant, OrderedDict())[block.block_id] = block

    def cache_block(self, block: Block, block_hash: BlockHash) -> bool:
        """Registers a full, computed block under its chained hash. Returns False when caching is
        off or another block already holds that prefix (this one then stays private)."""
        if not self.enable_caching or block_hash in self._cached:
            return False
        assert block.block_hash is None and block.ref_cnt > 0
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def _evict(self, block: Block) -> None:
        assert self._cached.get(block.block_hash) is block  # type: ignore[arg-type]
        del self._cached[block.block_hash]  # type: ignore[arg-type]
        block.block_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix held only by free blocks; returns how many."""
        dropped = [b for b in self._free.values() if b.block_hash is not None]
        for block in dropped:
            self._evict(block)
            self._free.move_to_end(block.block_id, last=False)
        self._cached_free.clear()
        return len(dropped)

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(self.num_blocks, len(self._free), len(self._cached), self.num_evictions)

    def check_integrity(self) -> None:
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in self._free), block
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, block
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash
        assert all(self._free[i] is self.blocks[i] for i in self._free)
        for tenant, n in self.in_use.items():
            assert n == sum(1 for b in self.blocks if b.ref_cnt > 0 and b.tenant == tenant), (tenant, n)
        listed = {i for blocks in self._cached_free.values() for i in blocks}
        assert listed == {b.block_id for b in self._free.values() if b.block_hash is not None}, "cached-free lists"
        assert all(b.tenant == t for t, blocks in self._cached_free.items() for b in blocks.values())
