"""What a stored block is worth, and which blocks must leave a tier so another may enter.

Mental model: every block carries a value key, one float whose order is the order in which blocks
are worth keeping. In "value" mode the key is `log2(weight * score) + stamp / half_life`: `score`
is the block's use count decayed by half every `half_life` bytes of store traffic, `stamp` the
traffic clock at its last use, `weight` a prior (earlier blocks of a chain are needed by every
longer prefix, so weight falls with depth; a request's private KV shadows weigh little). A key
computed at the last use compares correctly with one computed at any other time, because decay
subtracts the same `elapsed / half_life` from every log-score: so keys never need refreshing and
a heap orders them. In "lru" mode the key is the stamp alone (plain LRU, the baseline).
Ties are broken by a sequence number: the block used last is worth more.

`TierIndex` holds one tier's keys: a heap per tenant (lazy deletion, rebuilt when half stale)
and the bytes each tenant holds there. `plan_room` picks the victims that make room for a block,
or refuses it: with tenant shares off, the lowest-valued blocks of the tier; with shares on, a
tenant at its maximum takes only from its own blocks, others take first from the tenant furthest
above its guarantee (`TenantShares.eviction_order`), never from another tenant within its
guarantee. A victim worth more than the newcomer refuses it, unless the newcomer's tenant is
claiming room within its own guarantee from a tenant above its guarantee.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Literal

from actors.engine.block_hash import BlockHash
from actors.engine.shares import TenantShares

Tier = Literal["dram", "disk"]
EvictionReason = Literal["value", "share", "own"]  # lowest value / taken from a tenant over its share / own, at its max
Refusal = Literal["size", "at_max", "value"]  # larger than the tier / its tenant is at its maximum there / worth less


@dataclass(slots=True)
class BlockMeta:
    """One stored block's bookkeeping (the payload lives in its tier)."""

    tenant: str
    size: int  # payload bytes
    weight: float  # prior from depth and kind, > 0
    score: float  # uses, decayed to `stamp`
    stamp: float  # traffic clock (bytes) at the last use
    tier: Tier
    key: float = 0.0
    seq: int = 0  # tie-break; also tells a live heap entry from a stale one
    prefetched: bool = False  # promoted by a prefetch and not read since
    read_counted: bool = False  # a prefetch counted the use its next read makes
    shadow: bool = False  # a request's private KV shadow, not a prefix anyone else can match


def block_weight(depth: int, shadow: bool, depth_scale: float, shadow_weight: float) -> float:
    return (shadow_weight if shadow else 1.0) / (1.0 + depth / depth_scale)


class ValueClock:
    """The store's traffic clock and key function; `use` records one use of a block now."""

    def __init__(self, mode: Literal["value", "lru"], half_life_bytes: float) -> None:
        assert half_life_bytes > 0
        self.mode = mode
        self.half_life_bytes = half_life_bytes
        self.now = 0.0  # bytes of traffic so far
        self._seq = 0

    def advance(self, num_bytes: int) -> None:
        self.now += num_bytes

    def use(self, meta: BlockMeta, uses: float) -> None:
        """Adds `uses` to `meta`'s decayed score at the current time and rekeys it."""
        decayed = meta.score * 2.0 ** (-(self.now - meta.stamp) / self.half_life_bytes)
        meta.score, meta.stamp = decayed + uses, self.now
        self.rekey(meta)

    def rekey(self, meta: BlockMeta) -> None:
        self._seq += 1
        meta.seq = self._seq
        if self.mode == "lru":
            meta.key = meta.stamp
        else:
            meta.key = math.log2(meta.weight * max(meta.score, 1e-300)) + meta.stamp / self.half_life_bytes


_Entry = tuple[float, int, BlockHash]  # (key, seq, hash): heap order is value order


class TierIndex:
    """One tier's value order per tenant and bytes per tenant; the store keeps the payloads."""

    def __init__(self, tier: Tier, capacity_bytes: int, metas: dict[BlockHash, BlockMeta]) -> None:
        self.tier = tier
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.usage: dict[str, int] = {}  # tenant -> payload bytes here
        self._metas = metas  # the store's index of every block (shared, read only here)
        self._heaps: dict[str, list[_Entry]] = {}
        self._live: dict[str, int] = {}  # tenant -> blocks here

    def __len__(self) -> int:
        return sum(self._live.values())

    def add(self, h: BlockHash, meta: BlockMeta) -> None:
        assert meta.tier == self.tier and self.used_bytes + meta.size <= self.capacity_bytes
        self.used_bytes += meta.size
        self.usage[meta.tenant] = self.usage.get(meta.tenant, 0) + meta.size
        self._live[meta.tenant] = self._live.get(meta.tenant, 0) + 1
        self._push(h, meta)

    def discard(self, meta: BlockMeta) -> None:
        """Forgets a block that leaves this tier (its heap entry goes stale)."""
        self.used_bytes -= meta.size
        self.usage[meta.tenant] -= meta.size
        self._live[meta.tenant] -= 1
        if not self._live[meta.tenant]:
            del self.usage[meta.tenant], self._live[meta.tenant], self._heaps[meta.tenant]

    def rekeyed(self, h: BlockHash, meta: BlockMeta) -> None:
        """`meta`'s key changed while it stays here."""
        self._push(h, meta)

    def _push(self, h: BlockHash, meta: BlockMeta) -> None:
        heap = self._heaps.setdefault(meta.tenant, [])
        heapq.heappush(heap, (meta.key, meta.seq, h))
        if len(heap) > 2 * self._live[meta.tenant] + 16:  # mostly stale: rebuild, amortized O(1)
            heap[:] = [e for e in heap if self._is_live(e)]
            heapq.heapify(heap)

    def _is_live(self, entry: _Entry) -> bool:
        meta = self._metas.get(entry[2])
        return meta is not None and meta.tier == self.tier and meta.seq == entry[1]

    def _lowest(self, tenant: str) -> _Entry | None:
        heap = self._heaps.get(tenant)
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)
        return heap[0] if heap else None

    def order(self) -> list[BlockHash]:
        """Every block here, the next to leave first."""
        live = [e for heap in self._heaps.values() for e in heap if self._is_live(e)]
        return [h for _, _, h in sorted(live)]

    def plan_room(self, tenant: str, size: int, key: tuple[float, int],
                  shares: TenantShares) -> list[tuple[BlockHash, EvictionReason]] | Refusal:
        """The blocks to evict, in order, so that `tenant`'s block of `size` bytes worth `key`
        fits; or why it is refused: too big, its tenant at its maximum with nothing cheaper of
        its own, or every block it could displace worth more (or another tenant's guaranteed
        part). Changes nothing: the caller evicts the victims."""
        if size > self.capacity_bytes:
            return "size"
        usage = dict(self.usage)
        free = self.capacity_bytes - self.used_bytes
        victims: list[tuple[BlockHash, EvictionReason]] = []
        taken: dict[str, list[_Entry]] = {}  # popped while planning; pushed back before returning
        try:
            while True:
                own = usage.get(tenant, 0)
                at_max = shares.enabled and shares.over_limit(tenant, own, size, self.capacity_bytes)
                if free >= size and not at_max:
                    return victims
                victim = self._pick(tenant, at_max, usage, shares)
                if victim is None:
                    return "at_max" if at_max else "value"
                v_tenant, entry = victim
                claim = (shares.enabled and v_tenant != tenant
                         and own + size <= shares.guarantee(tenant, self.capacity_bytes))
                if (entry[0], entry[1]) >= key and not claim:
                    return "at_max" if at_max else "value"
                heapq.heappop(self._heaps[v_tenant])
                taken.setdefault(v_tenant, []).append(entry)
                meta = self._metas[entry[2]]
                usage[v_tenant] -= meta.size
                free += meta.size
                reason: EvictionReason = ("own" if at_max else
                                          "share" if shares.enabled and v_tenant != tenant else "value")
                victims.append((entry[2], reason))
        finally:
            for t, entries in taken.items():
                for entry in entries:
                    heapq.heappush(self._heaps[t], entry)

    def _pick(self, tenant: str, at_max: bool, usage: dict[str, int],
              shares: TenantShares) -> tuple[str, _Entry] | None:
        """The next victim's tenant and heap entry (not yet popped), or None: nothing may go."""
        if at_max:
            lowest = self._lowest(tenant)
            return None if lowest is None else (tenant, lowest)
        lowest_of = {t: e for t in self._heaps if (e := self._lowest(t)) is not None}
        if not lowest_of:
            return None
        if not shares.enabled:
            t = min(lowest_of, key=lambda t: lowest_of[t][:2])
            return t, lowest_of[t]
        for t in shares.eviction_order(usage, self.capacity_bytes, lowest_of):
            within = usage.get(t, 0) <= shares.guarantee(t, self.capacity_bytes)
            if t == tenant or not within:  # another tenant's guarantee is never taken
                return t, lowest_of[t]
        return None

    def check_integrity(self) -> None:
        mine = {h: m for h, m in self._metas.items() if m.tier == self.tier}
        assert self.used_bytes == sum(m.size for m in mine.values()), f"{self.tier} byte count"
        assert 0 <= self.used_bytes <= self.capacity_bytes, f"{self.tier} over its bound"
        per_tenant: dict[str, int] = {}
        for m in mine.values():
            per_tenant[m.tenant] = per_tenant.get(m.tenant, 0) + m.size
        assert per_tenant == self.usage, f"{self.tier} bytes per tenant"
        live = {e[2] for heap in self._heaps.values() for e in heap if self._is_live(e)}
        assert live == set(mine), f"{self.tier} value heaps differ from the index"
