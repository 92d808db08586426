"""Tenant isolation comes from the hash (a per-tenant salt in extra_keys), not from the stores."""

from __future__ import annotations

import pytest

from actors.engine.block_hash import BlockHash, hash_block_chain
from actors.prefix_cache.handles import LocalStoreHandle
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore

BLOCK = 4
SYSTEM_PROMPT = list(range(1000, 1016))  # 4 blocks every tenant may share
USER_PROMPT = list(range(7, 31))  # 6 blocks, typed identically by both tenants


def blob(h: BlockHash) -> bytes:
    return h.to_bytes(16, "little")


@pytest.fixture
def pool() -> PrefixCachePool:
    cfg = PrefixCacheConfig(dram_bytes=1 << 16, enable_disk=False)
    stores = {StoreId(f"s{i}"): LocalStoreHandle(PrefixCacheStore(cfg, f"s{i}")) for i in range(3)}
    return PrefixCachePool(stores)


def salted(tenant: str, tokens: list[int]) -> list[BlockHash]:
    return hash_block_chain(tokens, BLOCK, extra_keys=(f"tenant:{tenant}",))


def test_same_tokens_with_different_salts_never_match(pool: PrefixCachePool) -> None:
    tokens = SYSTEM_PROMPT + USER_PROMPT
    chain_a, chain_b = salted("a", tokens), salted("b", tokens)
    assert not set(chain_a) & set(chain_b)
    assert pool.put([(h, blob(h)) for h in chain_a]).wait() == 10
    assert pool.match_prefix(chain_a) == 10
    assert pool.match_prefix(chain_b) == 0 and pool.get_prefix(chain_b) == []
    assert pool.match_prefix(salted("a", tokens)) == 10  # the same tenant, recomputed: a hit


def test_an_opted_in_shared_prefix_matches_across_tenants_and_no_further(pool: PrefixCachePool) -> None:
    shared = hash_block_chain(SYSTEM_PROMPT, BLOCK)  # unsalted: shared by opting in
    # Each tenant's own blocks continue the shared chain under its salt.
    chain_a = shared + hash_block_chain(USER_PROMPT, BLOCK, ("tenant:a",), parent_hash=shared[-1])
    chain_b = shared + hash_block_chain(USER_PROMPT, BLOCK, ("tenant:b",), parent_hash=shared[-1])
    pool.put([(h, blob(h)) for h in chain_a]).wait()
    assert pool.match_prefix(chain_a) == 10
    assert pool.match_prefix(chain_b) == 4  # the system prompt only
    assert pool.get_prefix(chain_b) == [blob(h) for h in shared]
    # Without opting in, tenant b's system prompt is salted too and shares nothing.
    assert pool.match_prefix(salted("b", SYSTEM_PROMPT + USER_PROMPT)) == 0
