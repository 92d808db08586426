import pytest

from actors.engine.block_hash import ROOT_HASH, hash_block, hash_block_chain
from actors.engine.block_pool import BlockPool, OutOfBlocks


def test_hash_chain_is_prefix_identity():
    a = hash_block_chain(list(range(40)), 16)
    b = hash_block_chain(list(range(32)) + [99] * 8, 16)
    assert len(a) == 2 and a == b  # the partial third block has no hash
    c = hash_block_chain([5] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a changed first block changes every later hash
    assert hash_block(ROOT_HASH, range(16), ("tenant-a",)) != hash_block(ROOT_HASH, range(16), ("tenant-b",))
    assert hash_block(ROOT_HASH, list(range(16))) == a[0]
    assert 0 < a[0] < 2**128


def test_allocate_free_lru_order_and_eviction():
    pool = BlockPool(6)
    x = pool.allocate(3)
    assert [b.block_id for b in x] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in x)
    for i, b in enumerate(x):
        assert pool.cache_block(b, 100 + i)
    y = pool.allocate(2)
    assert [b.block_id for b in y] == [3, 4]
    pool.free(reversed(x))  # tail first: block 2 is the first cached block to be evicted
    pool.free(y)  # uncached: to the front of the queue, reused first
    assert pool.free_block_ids() == [4, 3, 5, 2, 1, 0]
    pool.check_integrity()

    z = pool.allocate(4)  # 4, 3, 5 carry nothing; 2 is evicted
    assert [b.block_id for b in z] == [4, 3, 5, 2]
    assert pool.get_cached_block(102) is None and pool.get_cached_block(101).block_id == 1
    assert pool.num_evictions == 1
    pool.check_integrity()

    pool.touch([pool.get_cached_block(100)])  # revived from the free queue
    assert pool.free_block_ids() == [1]
    assert not pool.can_allocate(2)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    pool.check_integrity()


def test_shared_block_refcount_and_double_free():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache_block(b, 7)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([b])
    assert pool.num_free_blocks == 2 and pool.get_cached_block(7) is b
    with pytest.raises(AssertionError):
        pool.free([b])


def test_duplicate_hash_stays_private_and_caching_off():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 1)
    assert not pool.cache_block(b, 1)
    assert b.block_hash is None and pool.get_cached_block(1) is a
    off = BlockPool(2, enable_caching=False)
    [c] = off.allocate(1)
    assert not off.cache_block(c, 1) and off.get_cached_block(1) is None
    pool.free([a, b])
    assert pool.reset_prefix_cache() == 1 and pool.get_cached_block(1) is None
    pool.check_integrity()
