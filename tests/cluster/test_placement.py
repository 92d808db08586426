"""Prefix index matching and placement by predicted time with prefix affinity."""

from __future__ import annotations

import random

from actors.engine.block_hash import hash_block_chain
from cluster.config import SchedulerConfig
from cluster.descriptors import WorkerKind
from cluster.placement import Placement, PlacementConfig
from cluster.prefix_index import POOL, PrefixIndex
from tests.cluster.helpers import W, desc, load, make


def test_longest_prefix_match_equals_brute_force() -> None:
    rng = random.Random(0)
    chain = hash_block_chain(list(range(16 * 300)), 16)
    idx = PrefixIndex()
    held = {}
    for w in range(6):
        k = rng.choice([0, 1, 2, 7, 64, 65, 150, 299, 300])
        idx.add(W(f"w{w}"), chain[:k])
        held[f"w{w}"] = k
    idx.add(POOL, chain[:5])
    idx.check_integrity()
    for n in (1, 2, 3, 64, 100, 300):
        got = idx.match(chain[:n])
        want = {w: min(k, n) for w, k in held.items() if k > 0}
        want[POOL] = min(5, n)
        assert got == want
    idx.remove(W("w0"), chain)
    idx.drop(W("w1"))
    idx.check_integrity()
    assert W("w0") not in idx.match(chain) and W("w1") not in idx.match(chain)


def test_prefill_prefers_the_worker_holding_the_prefix_until_its_queue_outweighs_it() -> None:
    hashes = tuple(hash_block_chain(list(range(16 * 250)), 16))  # a 4000-token shared prefix
    cfg = SchedulerConfig(placement=PlacementConfig(hash_block_size=16), heartbeat_timeout_s=1e6)
    sched, _ = make(cfg, prefill=3)
    sched.on_report(load("p2", WorkerKind.PREFILL, added=hashes))
    first = sched.submit(desc("a", prompt=4100, hashes=hashes))
    assert isinstance(first, Placement) and first.prefill_worker == "p2"
    assert first.num_prefix_hit_blocks == 250 and first.num_pool_blocks == 0
    # p2 computes 100 tokens per request (~9 ms) where others compute 4100 (~160 ms): it keeps
    # winning until its queue exceeds an idle worker's full recompute.
    chosen = [sched.submit(desc(f"r{i}", prompt=4100, hashes=hashes)) for i in range(30)]
    workers = [p.prefill_worker for p in chosen if isinstance(p, Placement)]
    assert workers[:10] == ["p2"] * 10
    assert "p0" in workers and "p1" in workers
    sched.check_integrity()


def test_pool_hits_are_fetched_and_cheaper_than_recompute() -> None:
    hashes = tuple(hash_block_chain(list(range(16 * 100)), 16))
    fetch = 1e-4
    cfg = SchedulerConfig(placement=PlacementConfig(hash_block_size=16, pool_fetch_s_per_block=fetch))
    sched, _ = make(cfg, prefill=2)
    sched.on_pool_report(added=hashes[:80])
    sched.on_report(load("p1", WorkerKind.PREFILL, added=hashes[:20]))
    p = sched.submit(desc("a", prompt=1700, hashes=hashes))
    assert isinstance(p, Placement)
    assert p.prefill_worker == "p1"  # fetches 60 blocks where p0 would fetch 80
    assert (p.num_prefix_hit_blocks, p.num_pool_blocks) == (80, 60)


def test_decode_goes_where_tpot_headroom_is_largest_and_blocks_fit() -> None:
    sched, _ = make(SchedulerConfig(heartbeat_timeout_s=1e6), prefill=1, decode=3, decode_blocks=1000)
    sched.on_report(load("d0", WorkerKind.DECODE, free=10, total=1000))  # nearly full
    out = [sched.submit(desc(f"r{i}", prompt=1000, max_tokens=64)) for i in range(6)]
    decoders = [p.decode_worker for p in out if isinstance(p, Placement)]
    assert "d0" not in decoders
    assert sorted(decoders) == ["d1", "d1", "d1", "d2", "d2", "d2"]  # spread by headroom
    sched.check_integrity()
