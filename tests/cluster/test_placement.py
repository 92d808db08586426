"""Prefix index matching and placement by predicted time with prefix affinity."""

from __future__ import annotations

import random

import pytest

from actors.engine.block_hash import hash_block_chain
from cluster.config import SchedulerConfig
from cluster.cost_model import prefill_pairs
from cluster.descriptors import WorkerKind
from cluster.journal import Phase
from cluster.placement import Placement, PlacementConfig
from cluster.prefix_index import POOL, PrefixIndex
from cluster.tenants import InteractiveSlo, TenantConfig
from cluster.timeline import Stage
from tests.cluster.helpers import R, T, W, desc, load, make


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


def _local_cfg(local_prefill: bool = True) -> SchedulerConfig:
    slo = InteractiveSlo(ttft_ms=1e6, tpot_ms=50.0)
    return SchedulerConfig(default_tenant=TenantConfig(T("default"), slo=slo), heartbeat_timeout_s=1e6,
                           placement=PlacementConfig(local_prefill=local_prefill))


def test_decode_workers_prefill_for_themselves_when_that_gives_the_first_token_sooner() -> None:
    # Prior: a 4000-token prefill is ~159 ms on a prefill worker. On an idle decode worker its
    # 154 ms of token work is chunked into steps of 5 ms + 37.5 ms (0.85 x 50 ms TPOT): ~174 ms,
    # d1 first (d0 already has r0's row committed, so its steps are a little longer).
    sched, _ = make(_local_cfg(), prefill=1, decode=2)
    out = [sched.submit(desc(f"r{i}", prompt=4000)) for i in range(4)]
    assert all(isinstance(p, Placement) for p in out)
    assert [p.prefill_worker for p in out] == ["p0", "d1", "d0", "p0"]  # type: ignore[union-attr]
    assert [p.local for p in out] == [False, True, True, False]  # type: ignore[union-attr]
    # r3 waits for r0 on p0 (2 x 158.6 ms), yet that beats d1's and d0's queues of one chunked prefill.
    assert out[3].predicted_ttft_s == pytest.approx(2 * out[0].predicted_ttft_s)  # type: ignore[union-attr]
    assert out[0].predicted_ttft_s < out[1].predicted_ttft_s < out[3].predicted_ttft_s < 2 * out[1].predicted_ttft_s  # type: ignore[union-attr]
    d1 = sched.workers.get(W("d1"))
    assert d1 is not None and d1.backlog_s[0] > 0 and d1.num_committed == 2  # r1 here, r3 from p0
    # A local prefill carries the chunk it was predicted with: as many tokens as fit beside the
    # worker's rows (none yet on d1) under 0.85 x 50 ms; a placement on p0 carries none.
    assert out[0].local_chunk_tokens is None and out[3].local_chunk_tokens is None  # type: ignore[union-attr]
    n = out[1].local_chunk_tokens  # type: ignore[union-attr]
    model = sched.models.get(W("d1"))
    step = lambda k: model.predict(k, prefill_pairs(k, 0), 0, 0)  # noqa: E731
    assert n is not None and 16 <= n < 4000 and step(n) <= 0.85 * 0.05 < step(n + 1)
    assert out[2].local_chunk_tokens < n  # type: ignore[union-attr]  # d0 has r0's row coming: less room
    # Its first token means it decodes where it was prefilled: nothing to hand over.
    sched.on_stage(R("r1"), Stage.PREFILL_START)
    sched.on_token(R("r1"))
    entry = sched.journal.get(R("r1"))
    assert entry is not None and entry.phase is Phase.DECODING
    assert (d1.backlog_s[0], d1.num_committed, d1.num_active) == (0.0, 1, 1)
    sched.check_integrity()
    # Off (the default), every prefill waits for the prefill worker.
    off, _ = make(_local_cfg(False), prefill=1, decode=2)
    assert {p.prefill_worker for p in (off.submit(desc(f"r{i}", prompt=4000)) for i in range(4))} == {"p0"}  # type: ignore[union-attr]


def test_a_local_prefill_counts_the_pools_blocks_too() -> None:
    """A decode worker fetches the pool's blocks before prefilling for itself: with the whole prefix
    in the pool, a busy prefill worker loses to a decode worker that computes only the tail."""
    hashes = tuple(hash_block_chain(list(range(16 * 250)), 16))
    slo = InteractiveSlo(ttft_ms=1e6, tpot_ms=50.0)
    cfg = SchedulerConfig(default_tenant=TenantConfig(T("default"), slo=slo), heartbeat_timeout_s=1e6,
                          placement=PlacementConfig(local_prefill=True, pool_fetch_s_per_block=1e-5))
    sched, _ = make(cfg, prefill=1, decode=1)
    sched.on_pool_report(added=hashes[:240])
    first = sched.submit(desc("r0", prompt=4000, hashes=hashes))  # the idle prefill worker, pool blocks and all
    assert isinstance(first, Placement) and not first.local and first.num_pool_blocks == 240
    second = sched.submit(desc("r1", prompt=4000, hashes=hashes))
    assert isinstance(second, Placement) and second.local  # 160 tokens beside its rows beat waiting for r0
    assert (second.num_prefix_hit_blocks, second.num_pool_blocks) == (240, 240)
    assert second.predicted_ttft_s < 2 * first.predicted_ttft_s
    sched.check_integrity()


def test_local_prefill_chunks_fill_the_step_to_the_tightest_tpot_target() -> None:
    sched, _ = make(_local_cfg(), prefill=1, decode=1)
    assert sched.local_chunk_tokens(W("d0"), 0, 0, 0) == PlacementConfig().max_local_chunk_tokens  # no target yet
    p = sched.submit(desc("a", prompt=2000))
    assert isinstance(p, Placement)
    sched.on_stage(p.request_id, Stage.DECODE_ADMITTED)  # a running row with a 50 ms target
    model = sched.models.get(W("d0"))
    for rows, done in ((1, 0), (40, 0), (40, 3000)):
        n = sched.local_chunk_tokens(W("d0"), rows, rows * 2000, done)
        step = lambda k: model.predict(k, prefill_pairs(k, done), rows, rows * 2000)  # noqa: E731
        assert n > 0 and step(n) <= 0.85 * 0.05 < step(n + 1), (rows, done, n)
    assert sched.local_chunk_tokens(W("d0"), 600, 600 * 2000, 0) == 0  # the rows alone fill the step
