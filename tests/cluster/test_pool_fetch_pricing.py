"""Pool hits priced by the fetch time each worker measured: the figure travels from the worker's
load (`WorkerLoad`) through its report (`WorkerReport`) into the scheduler's view (`WorkerView`),
and placement charges a worker's missing prefix blocks at its own rate (the configured constant
until it has one)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from actors.engine.block_hash import hash_block_chain
from actors.messages import WorkerLoad as ActorLoad
from cluster.config import SchedulerConfig
from cluster.descriptors import WorkerKind, WorkerReport
from cluster.placement import Placement, PlacementConfig
from cluster.router.adapters import worker_load
from cluster.tenants import InteractiveSlo, TenantConfig
from tests.cluster.helpers import T, W, desc, load, make

HASHES = tuple(hash_block_chain(list(range(16 * 250)), 16))  # a 4000-token prefix
SLOW, CHEAP = 1e-3, 1e-5  # seconds per block: 250 blocks take 250 ms or 2.5 ms


def _measured(name: str, kind: WorkerKind, fetch_s: float | None, added: tuple[int, ...] = ()) -> WorkerReport:
    return replace(load(name, kind, added=added), pool_fetch_s_per_block=fetch_s)


def test_the_measured_fetch_time_travels_from_the_load_to_the_view() -> None:
    plain = ActorLoad("p0", "prefill", 1, 0, 0, 50, 100, 0.01, True)
    assert plain.pool_fetch_s_per_block is None  # no pool, or nothing fetched yet
    assert worker_load(plain, 5.0, 16).pool_fetch_s_per_block is None
    report = worker_load(replace(plain, pool_fetch_s_per_block=0.0025), 5.0, 16)
    assert report.pool_fetch_s_per_block == 0.0025 and report.kind is WorkerKind.PREFILL

    sched, _ = make(prefill=1, decode=1)
    view = sched.workers.get(W("p0"))
    assert view is not None and view.pool_fetch_s_per_block is None
    sched.on_report(report)
    assert view.pool_fetch_s_per_block == 0.0025
    sched.on_report(worker_load(replace(plain, pool_fetch_s_per_block=0.004), 6.0, 16))
    assert view.pool_fetch_s_per_block == 0.004  # the worker smooths; the view keeps its latest
    sched.on_report(worker_load(plain, 7.0, 16))  # a restarted worker has measured nothing yet
    assert view.pool_fetch_s_per_block is None
    for bad in (-1e-3, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="pool_fetch_s_per_block"):
            replace(report, pool_fetch_s_per_block=bad)


def _prefill_race(p0_fetch_s: float | None, configured_s: float = 0.0) -> tuple[Placement, Placement]:
    """p1 holds the whole prefix; the pool holds it too; p0 holds none of it and must fetch. r0
    goes to p1 (it computes 100 tokens, ~9 ms); r1 then waits behind r0 on p1, or goes to p0, which
    fetches 250 blocks at its rate and computes the same 100 tokens."""
    cfg = SchedulerConfig(placement=PlacementConfig(hash_block_size=16, pool_fetch_s_per_block=configured_s),
                          heartbeat_timeout_s=1e6)
    sched, _ = make(cfg, prefill=2)
    sched.on_pool_report(added=HASHES)
    sched.on_report(_measured("p0", WorkerKind.PREFILL, p0_fetch_s))
    sched.on_report(_measured("p1", WorkerKind.PREFILL, SLOW, added=HASHES))
    first, second = (sched.submit(desc(f"r{i}", prompt=4100, hashes=HASHES)) for i in range(2))
    assert isinstance(first, Placement) and isinstance(second, Placement)
    assert first.prefill_worker == "p1" and first.num_pool_blocks == 0  # p1 never fetches: its rate is moot
    sched.check_integrity()
    return first, second


def test_a_slow_measured_fetch_keeps_the_request_with_the_worker_holding_the_prefix() -> None:
    first, second = _prefill_race(SLOW)
    assert second.prefill_worker == "p1" and second.num_pool_blocks == 0
    # r1 waits for r0's compute there: about twice r0's first-token time, still under 250 ms of fetching.
    assert second.predicted_ttft_s == pytest.approx(2 * first.predicted_ttft_s)
    assert second.predicted_ttft_s < 250 * SLOW


def test_a_cheap_measured_fetch_sends_the_request_to_the_idle_worker_that_fetches() -> None:
    first, second = _prefill_race(CHEAP)
    assert second.prefill_worker == "p0"
    assert (second.num_prefix_hit_blocks, second.num_pool_blocks) == (250, 250)
    assert second.predicted_ttft_s == pytest.approx(first.predicted_ttft_s + 250 * CHEAP)


def test_the_configured_constant_prices_workers_that_have_not_measured_and_only_those() -> None:
    # Unmeasured, p0's fetches cost what the configuration says.
    assert _prefill_race(None, configured_s=SLOW)[1].prefill_worker == "p1"
    assert _prefill_race(None, configured_s=CHEAP)[1].prefill_worker == "p0"
    # Measured, its own figure wins over the configuration, either way.
    assert _prefill_race(CHEAP, configured_s=SLOW)[1].prefill_worker == "p0"
    assert _prefill_race(SLOW, configured_s=CHEAP)[1].prefill_worker == "p1"
    assert _prefill_race(SLOW, configured_s=0.0)[1].prefill_worker == "p1"  # the default prices hits free


def test_a_decode_worker_prefills_for_itself_only_when_its_own_fetches_are_cheap() -> None:
    """The pool holds 240 of the prefix's blocks, no worker any. r0 goes to the idle prefill worker
    (unmeasured: the configured 1e-5 s a block); r1 would wait behind it there, so the decode worker
    prefills it itself after fetching the 240 blocks, unless it measured its fetches as slow."""
    slo = InteractiveSlo(ttft_ms=1e6, tpot_ms=50.0)
    placements = {}
    for d0_fetch_s in (CHEAP, SLOW):
        cfg = SchedulerConfig(default_tenant=TenantConfig(T("default"), slo=slo), heartbeat_timeout_s=1e6,
                              placement=PlacementConfig(local_prefill=True, pool_fetch_s_per_block=CHEAP))
        sched, _ = make(cfg, prefill=1, decode=1)
        sched.on_pool_report(added=HASHES[:240])
        sched.on_report(_measured("d0", WorkerKind.DECODE, d0_fetch_s))
        first, second = (sched.submit(desc(f"r{i}", prompt=4000, hashes=HASHES)) for i in range(2))
        assert isinstance(first, Placement) and not first.local and first.num_pool_blocks == 240
        assert isinstance(second, Placement)
        placements[d0_fetch_s] = (first, second)
        sched.check_integrity()
    first, cheap = placements[CHEAP]
    assert cheap.local and cheap.num_pool_blocks == 240
    assert cheap.predicted_ttft_s < 2 * first.predicted_ttft_s
    first, slow = placements[SLOW]
    assert not slow.local and slow.prefill_worker == "p0"  # 240 ms of fetching lose to waiting for r0
    assert slow.predicted_ttft_s == pytest.approx(2 * first.predicted_ttft_s)
