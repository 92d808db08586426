"""Per-tenant shares of a bounded KV store: a guaranteed part nobody else may evict, and a ceiling.

Mental model: a store of `capacity` units (engine KV blocks, or a prefix-pool tier's bytes) is
shared by tenants. Each has a `TenantShare`: `guaranteed` (a fraction of the capacity other tenants
cannot take from it while it uses no more than that) and `max` (a fraction it may never exceed).
When room must be made, the tenant furthest above its guarantee gives first (`eviction_order`); a
tenant at its ceiling waits for its own room (`over_limit`) rather than taking anyone else's.
Tenants not listed get `default` (no guarantee, no ceiling): with no shares configured, every
decision falls back to the store's own order (LRU), exactly as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TenantShare:
    guaranteed: float = 0.0
    max: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.guaranteed <= self.max <= 1.0 or self.max <= 0.0:
            raise ValueError(f"a KV share needs 0 <= guaranteed <= max <= 1 and max > 0, got "
                             f"guaranteed {self.guaranteed}, max {self.max}")


@dataclass(frozen=True)
class TenantShares:
    shares: tuple[tuple[str, TenantShare], ...] = ()
    default: TenantShare = field(default_factory=TenantShare)

    def __post_init__(self) -> None:
        names = [name for name, _ in self.shares]
        if len(set(names)) != len(names):
            raise ValueError(f"a tenant is listed twice in the KV shares: {names}")
        if sum(s.guaranteed for _, s in self.shares) > 1.0 + 1e-9:
            raise ValueError("the tenants' guaranteed KV shares add up to more than the whole store")

    @classmethod
    def of_mapping(cls, shares: Mapping[str, TenantShare], default: TenantShare | None = None) -> "TenantShares":
        return cls(tuple(sorted(shares.items())), default or TenantShare())

    @property
    def enabled(self) -> bool:
        """False when no tenant has a guarantee or a ceiling: the store's plain order applies."""
        return any(s != TenantShare() for _, s in self.shares) or self.default != TenantShare()

    def of(self, tenant: str) -> TenantShare:
        for name, share in self.shares:
            if name == tenant:
                return share
        return self.default

    def limit(self, tenant: str, capacity: int) -> int:
        """Units `tenant` may hold at most (at least one, so any tenant can make progress)."""
        return max(1, int(self.of(tenant).max * capacity))

    def guarantee(self, tenant: str, capacity: int) -> int:
        return int(self.of(tenant).guaranteed * capacity)

    def over_limit(self, tenant: str, used: int, extra: int, capacity: int) -> bool:
        """Whether `tenant`, holding `used`, may not take `extra` more."""
        return used + extra > self.limit(tenant, capacity)

    def eviction_order(self, usage: Mapping[str, int], capacity: int, candidates: Iterable[str]) -> list[str]:
        """`candidates` (tenants with something evictable), those furthest above their guarantee
        first; tenants within their guarantee last, which the caller takes from only when nobody
        else has anything left (the guarantee protects against other tenants, not against the
        store being full of the tenant's own work)."""
        def excess(tenant: str) -> tuple[bool, float]:
            over = usage.get(tenant, 0) - self.guarantee(tenant, capacity)
            return over <= 0, -over / max(1, capacity)

        return sorted(candidates, key=excess)
