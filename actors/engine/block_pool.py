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

Held blocks (request-aware paging, paging.py): an empty free block may be *held* for a long request's
run (`hold`), kept apart from the free queue so that other allocations take it only after every other
empty block and before any cached prefix is evicted (soft holds: still counted free), or never (hard
holds: `hard_holds`, not counted free). `take` hands out given free blocks, for a run's contiguity.
`free_state` mirrors every block's state in one byte (IN_USE, FREE, FREE_CACHED, HELD) for the
policy's vectorised search of contiguous free ranges.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from actors.engine.block_hash import BlockHash
from actors.engine.errors import EngineError
from actors.engine.shares import TenantShares


IN_USE, FREE, FREE_CACHED, HELD = 0, 1, 2, 3  # `BlockPool.free_state` codes


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
    def __init__(self, num_blocks: int, enable_caching: bool = True, shares: TenantShares | None = None,
                 hard_holds: bool = False) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.shares = shares or TenantShares()
        self.hard_holds = hard_holds
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._held: OrderedDict[int, Block] = OrderedDict()  # empty free blocks held for runs, oldest first
        self.free_state = bytearray([FREE]) * num_blocks
        self._cached: dict[BlockHash, Block] = {}
        self.num_evictions = 0
        self.in_use: dict[str, int] = {}  # tenant -> its blocks with references
        # tenant -> its free blocks that hold a cached prefix, least recently used first
        self._cached_free: dict[str, OrderedDict[int, Block]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` may hand out: the free queue, plus held blocks unless holds are hard."""
        return len(self._free) + (0 if self.hard_holds else len(self._held))

    @property
    def num_held_blocks(self) -> int:
        return len(self._held)

    def free_block_ids(self) -> list[int]:
        """Free queue in eviction order (front first); held blocks are not in it."""
        return list(self._free)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self._cached.get(block_hash)

    def cached_free_ids(self) -> list[int]:
        """Free blocks holding a cached prefix, in eviction order (the global LRU; with tenant
        shares the order differs by tenant)."""
        return [i for i, b in self._free.items() if b.block_hash is not None]

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
                self.free_state[block.block_id] = IN_USE
                self.in_use[block.tenant] = self.in_use.get(block.tenant, 0) + 1
            block.ref_cnt += 1

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int, tenant: str = "") -> list[Block]:
        if num_blocks > self.num_free_blocks:
            raise OutOfBlocks(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out: list[Block] = []
        for _ in range(num_blocks):  # one at a time: `_next_victim` looks at the queue as it is now
            out += self._hand_out([self._next_victim()], tenant)
        return out

    def take(self, block_ids: Iterable[int], tenant: str = "") -> list[Block]:
        """Hands out these free blocks (held or not; a cached one loses its prefix), in this order."""
        blocks = [self.blocks[i] for i in block_ids]
        assert all(self.free_state[b.block_id] != IN_USE for b in blocks), "take of a block in use"
        return self._hand_out(blocks, tenant)

    def _hand_out(self, blocks: list[Block], tenant: str) -> list[Block]:
        for block in blocks:
            if self._held.pop(block.block_id, None) is None:
                del self._free[block.block_id]
            if block.block_hash is not None:
                self._unlist_cached_free(block)
                self._evict(block)
            self.free_state[block.block_id] = IN_USE
            block.ref_cnt = 1
            block.tenant = tenant
        self.in_use[tenant] = self.in_use.get(tenant, 0) + len(blocks)
        return blocks

    def hold(self, block_ids: Iterable[int]) -> None:
        """Sets these empty free blocks apart for a run (see the module docstring)."""
        for i in block_ids:
            assert self.free_state[i] == FREE, f"only an empty free block can be held, not {i}"
            self._held[i] = self._free.pop(i)
            self.free_state[i] = HELD

    def unhold(self, block_ids: Iterable[int]) -> None:
        """Returns held blocks to the free queue's front (empty blocks are reused first)."""
        for i in block_ids:
            if self.free_state[i] == HELD:
                self._free[i] = self._held.pop(i)
                self._free.move_to_end(i, last=False)
                self.free_state[i] = FREE

    def _next_victim(self) -> Block:
        """The free block to hand out next: an empty one (from the free queue, else a held one unless
        holds are hard), else a cached one, from the global LRU or, with tenant shares, the LRU of the
        tenant furthest above its guarantee."""
        block = next(iter(self._free.values()), None)
        if (block is None or block.block_hash is not None) and self._held and not self.hard_holds:
            return next(iter(self._held.values()))
        assert block is not None
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
                    self.free_state[block.block_id] = FREE
                    self._free.move_to_end(block.block_id, last=False)
                else:
                    self.free_state[block.block_id] = FREE_CACHED
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
            self.free_state[block.block_id] = FREE
            self._free.move_to_end(block.block_id, last=False)
        self._cached_free.clear()
        return len(dropped)

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(self.num_blocks, self.num_free_blocks, len(self._cached), self.num_evictions)

    def check_integrity(self) -> None:
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            held = block.block_id in self._held
            assert (block.ref_cnt == 0) == (block.block_id in self._free or held), block
            assert not (held and block.block_id in self._free), block
            state = HELD if held else IN_USE if block.ref_cnt else FREE_CACHED if block.block_hash is not None else FREE
            assert self.free_state[block.block_id] == state, (block, self.free_state[block.block_id])
            assert not held or block.block_hash is None, block
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
