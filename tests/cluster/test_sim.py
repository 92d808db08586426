"""The cluster simulator drives the real scheduler: small synthetic runs, failures, goodput helper."""

from __future__ import annotations

import random

import pytest

from actors.engine.block_hash import hash_block_chain
from bench.sim.cluster import ClusterSpec, SimCluster
from bench.sim.metrics import summarize
from bench.sim.policies import ColocatedRoundRobin, DisaggLoadOnly, Ours, SimPolicy
from bench.sim.request import DONE, SimRequest
from bench.sim.run import _bracket, goodput
from cluster.config import SchedulerConfig
from cluster.descriptors import TenantId
from cluster.placement import PlacementConfig
from cluster.tenants import InteractiveSlo, TenantConfig

BLOCK = 512


def _requests(n: int, rate: float, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    docs = [hash_block_chain(list(range(d * 10_000, d * 10_000 + 40)), 1) for d in range(4)]
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        if rng.random() < 0.5:  # half share one of four long documents as a prefix
            doc = docs[rng.randrange(4)]
            blocks = rng.randint(8, len(doc))
            prompt, hashes = blocks * BLOCK + rng.randint(1, 300), tuple(doc[:blocks])
        else:
            prompt, hashes = rng.randint(100, 3000), ()
        out.append(SimRequest(f"r{i}", "default", t, prompt, rng.randint(2, 150), hashes))
    return out


def _ours(local_prefill: bool = False) -> Ours:
    cfg = SchedulerConfig(default_tenant=TenantConfig(TenantId("default"), slo=InteractiveSlo(5000, 100)),
                          placement=PlacementConfig(hash_block_size=BLOCK, pool_fetch_s_per_block=0.0027,
                                                    local_prefill=local_prefill),
                          heartbeat_timeout_s=1.0)
    return Ours(cfg)


def _ours_local() -> Ours:
    return _ours(local_prefill=True)


def _run(router: SimPolicy, reqs: list[SimRequest], failures: tuple[tuple[float, str], ...] = ()) -> SimCluster:
    colocated = isinstance(router, ColocatedRoundRobin)
    spec = ClusterSpec(num_prefill=0 if colocated else 2, num_decode=0 if colocated else 2,
                       num_colocated=4 if colocated else 0, failures=failures)
    sim = SimCluster(spec, router)
    sim.run(reqs)
    return sim


@pytest.mark.parametrize("make_router", [ColocatedRoundRobin, DisaggLoadOnly, _ours, _ours_local])
def test_every_policy_serves_a_light_synthetic_load(make_router) -> None:  # type: ignore[no-untyped-def]
    reqs = _requests(300, rate=5.0)
    router = make_router()
    _run(router, reqs)
    assert all(r.state == DONE for r in reqs)
    fig = summarize(reqs, 5.0, 0.1)
    assert fig["num_unfinished"] == 0 and fig["attainment"] > 0.9
    if isinstance(router, Ours):
        router.sched.check_integrity()
        st = router.sched.stats()
        assert st.num_in_flight == 0 and st.num_finished == 300
        assert fig["prefix_cached_fraction"] > 0.3  # affinity + pool serve the shared documents


@pytest.mark.parametrize("make_router", [ColocatedRoundRobin, DisaggLoadOnly, _ours, _ours_local])
def test_failures_lose_no_request(make_router) -> None:  # type: ignore[no-untyped-def]
    reqs = _requests(400, rate=8.0, seed=1)
    colocated = make_router is ColocatedRoundRobin
    failures = ((15.0, "c"), (30.0, "c")) if colocated else ((15.0, "p"), (30.0, "d"))
    router = make_router()
    sim = _run(router, reqs, failures)
    assert all(r.state == DONE for r in reqs), [r.state for r in reqs if r.state != DONE][:5]
    affected = [r for r in reqs if r.affected_at is not None]
    assert len(sim.failures) == 2 and affected
    assert all(r.resume_t is not None and r.resume_t >= r.affected_at for r in affected)  # type: ignore[operator]
    # Every lost token count was carried over: each request emitted exactly its output.
    assert all(r.generated == r.out_len for r in reqs)
    if isinstance(router, Ours):
        assert router.sched.stats().num_workers_lost == 2
        assert router.sched.stats().num_recovered >= len([r for r in affected if r.num_losses])
        router.sched.check_integrity()


def test_decode_instances_prefill_for_themselves_when_the_prefill_instances_fall_behind() -> None:
    # Two prefill instances take ~2 x 28k prompt tokens/s; this load brings ~1.2x that, while
    # the two decode instances, with short outputs, have most of each step to spare.
    rng = random.Random(3)
    reqs, t = [], 0.0
    for i in range(600):
        t += rng.expovariate(75.0)
        reqs.append(SimRequest(f"r{i}", "default", t, rng.randint(600, 1200), rng.randint(2, 40), ()))
    runs = {}
    for local in (False, True):
        trial = [SimRequest(r.rid, r.tenant, r.arrival, r.prompt_len, r.out_len, r.hashes) for r in reqs]
        router = _ours(local)
        _run(router, trial)
        runs[local] = (summarize(trial, 1.0, 0.1), trial)
        router.sched.check_integrity()
        assert router.sched.stats().num_in_flight == 0
    on, trial = runs[True]
    served_here = [r for r in trial if r.prefill_inst is not None and r.prefill_inst.startswith("d")]
    assert served_here and all(r.decode_inst == r.prefill_inst for r in served_here)
    assert not any(r.prefill_inst.startswith("d") for r in runs[False][1] if r.prefill_inst)
    assert on["num_unfinished"] == 0 and on["tpot_p99_s"] <= 0.1
    off = runs[False][0]
    assert on["attainment"] > off["attainment"] and on["ttft_p99_s"] < off["ttft_p99_s"] / 2, (on, off)


def test_goodput_is_the_highest_rate_meeting_ninety_percent() -> None:
    points = {100.0: 0.99, 200.0: 0.91, 300.0: 0.6, 400.0: 0.95}
    assert goodput(points) == 400.0  # a noisy high point counts: it was measured
    assert _bracket({100.0: 0.99, 200.0: 0.91, 300.0: 0.6}) == (200.0, 300.0)
    assert _bracket({100.0: 0.5}) == (0.0, 100.0)
    assert _bracket({100.0: 0.95}) is None
    assert goodput({100.0: 0.5}) == 0.0


def test_profile_cost_fits_a_measured_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from bench.sim.hardware import ProfileCost

    def truth(p: int, rows: int, ctx: int) -> float:
        return 0.002 + 4e-5 * p + 1e-9 * p * p / 2 + 3e-4 * rows + 2e-8 * ctx

    entries = [{"prefill_tokens": p, "decode_rows": 0, "context_tokens": 0, "step_s": truth(p, 0, 0)}
               for p in (32, 128, 512, 1024, 2048)]
    entries += [{"prefill_tokens": 0, "decode_rows": b, "context_tokens": b * c, "step_s": truth(0, b, b * c)}
                for b, c in ((1, 64), (8, 512), (32, 128), (64, 1024))]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"entries": entries}))
    cost = ProfileCost(path, scale=0.5)
    assert cost.step_s(700, 700 * 350.0, 0, 0) == pytest.approx(0.5 * truth(700, 0, 0), rel=1e-6)
    assert cost.step_s(0, 0.0, 16, 16 * 300) == pytest.approx(0.5 * truth(0, 16, 16 * 300), rel=1e-6)
