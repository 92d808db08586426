"""The simulator's autoscaler: the real ScaleAdvisor's advice applied to a simulated fleet, a new
instance serving only after its node and replica start, drains that lose nothing, the diurnal
trace and the CLI's JSON."""

from __future__ import annotations

import json
import math

import pytest

from bench.sim.autoscale import Autoscaler, DiurnalCurve, StartDelays, diurnal_requests, main
from bench.sim.cluster import ClusterSpec, SimCluster
from bench.sim.policies import Ours
from bench.sim.request import DONE, REFUSED, SimRequest
from bench.sim.traces import TraceRequest
from cluster.config import SchedulerConfig
from cluster.descriptors import TenantId, WorkerName
from cluster.placement import PlacementConfig
from cluster.scaling import RoleBounds, ScalingConfig
from cluster.tenants import InteractiveSlo, TenantConfig


def _ours(prefill: RoleBounds, decode: RoleBounds, down_delay_s: float = 30.0) -> Ours:
    cfg = SchedulerConfig(default_tenant=TenantConfig(TenantId("default"), slo=InteractiveSlo(2000, 100)),
                          placement=PlacementConfig(local_prefill=False), heartbeat_timeout_s=1.0,
                          scaling=ScalingConfig(prefill=prefill, decode=decode, down_delay_s=down_delay_s))
    return Ours(cfg)


def _requests(spans: list[tuple[float, float, float, int, int]]) -> list[SimRequest]:
    """(start s, end s, req/s, prompt tokens, output tokens) per span, evenly spaced."""
    out: list[SimRequest] = []
    for start, end, rate, prompt, output in spans:
        for i in range(round((end - start) * rate)):
            out.append(SimRequest(f"r{len(out)}", "default", start + i / rate, prompt, output, ()))
    return out


def test_a_rising_load_adds_an_instance_that_serves_only_after_its_start_delay() -> None:
    router = _ours(RoleBounds(1, 2), RoleBounds(1, 1))
    sim = SimCluster(ClusterSpec(num_prefill=1, num_decode=1), router)
    scaler = Autoscaler(sim, router, StartDelays(node_add_s=5.0, replica_start_s=3.0))
    # light, then far more 8k-token prompts a second than one prefill instance computes
    reqs = _requests([(0.0, 10.0, 1.0, 2000, 20), (10.0, 40.0, 12.0, 8000, 20), (40.0, 80.0, 0.5, 500, 5)])
    sim.run(reqs)
    starts = [e for e in scaler.events if e.action == "start"]
    joins = [e for e in scaler.events if e.action == "join"]
    assert [e.role for e in starts] == ["p"] and [e.role for e in joins] == ["p"]  # max 2: one more, once
    assert starts[0].t > 10.0  # not while the load was light
    assert joins[0].t == starts[0].t + 8.0 and joins[0].name == "p1"
    on_new = [r for r in reqs if r.prefill_inst == "p1"]
    assert on_new and min(r.arrival for r in on_new) >= joins[0].t  # nothing placed there before it served
    assert all(r.state in (DONE, REFUSED) and r.num_losses == 0 for r in reqs)  # overload: some refused
    assert scaler.peak_nodes == 3
    assert all(e.t > joins[0].t for e in scaler.events if e.action == "drain")  # the trickle at the end


def test_a_falling_load_drains_one_instance_and_removes_it_once_idle_losing_nothing() -> None:
    router = _ours(RoleBounds(1, 1), RoleBounds(1, 2), down_delay_s=5.0)
    sim = SimCluster(ClusterSpec(num_prefill=1, num_decode=2), router)
    scaler = Autoscaler(sim, router, StartDelays(5.0, 3.0))
    # long outputs fill both decoders' rows early; a trickle of tiny requests keeps the run going
    reqs = _requests([(0.0, 8.0, 4.0, 1000, 1500), (8.0, 120.0, 0.5, 200, 2)])
    sim.run(reqs)
    drains = [e for e in scaler.events if e.action == "drain"]
    removes = [e for e in scaler.events if e.action == "remove"]
    assert len(drains) == 1 and drains[0].role == "d" and [e.name for e in removes] == [drains[0].name]
    name, t_drain, t_remove = drains[0].name, drains[0].t, removes[0].t
    held = [r for r in reqs if r.decode_inst == name]
    assert any(r.finish_t is not None and r.finish_t > t_drain for r in held)  # it had rows when drained
    assert all(r.arrival <= t_drain for r in held)  # nothing new went there
    assert t_remove >= max(r.finish_t or math.inf for r in held)  # removed only after its last row ended
    assert all(r.state == DONE and r.num_losses == 0 for r in reqs)
    assert name not in sim.instances and router.sched.workers.get(WorkerName(name)) is None
    assert scaler.count("start") == 0
    # node-hours: 3 nodes until the removal, 2 after
    assert scaler.node_hours(200.0) * 3600 == (3 * t_remove + 2 * (200.0 - t_remove))


def test_the_diurnal_trace_keeps_the_requests_and_follows_the_curve() -> None:
    curve = DiurnalCurve(low_rps=2.0, peak_rps=20.0, period_s=600.0)
    assert curve.rate(0.0) == 2.0 and curve.rate(300.0) == 20.0
    assert curve.expected(600.0) == pytest.approx(600 * 11.0)  # the mean of the two rates over the period
    trace = [TraceRequest(0.0, 100 + i, 10 + i, (i % 5, 1000 + i)) for i in range(50)]  # 5 shared first blocks
    reqs = diurnal_requests(trace, curve, seed=1)
    assert abs(len(reqs) - 6600) < 4 * math.sqrt(6600)
    assert [r.prompt_len for r in reqs[:120]] == [100 + i % 50 for i in range(120)]
    assert [r.out_len for r in reqs[:120]] == [10 + i % 50 for i in range(120)]
    assert reqs[3].hashes == (3, 1003) and reqs[53].hashes == tuple(hash((1, h)) for h in (3, 1003))
    assert reqs[53].hashes[0] == reqs[58].hashes[0] != reqs[3].hashes[0]  # shared within a pass, not across
    assert reqs[103].hashes[0] not in (reqs[3].hashes[0], reqs[53].hashes[0])
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] < 600.0
    trough = sum(t < 60 for t in arrivals)  # expected ~155
    middle = sum(270 <= t < 330 for t in arrivals)  # expected ~1191
    assert abs(trough - 155) < 4 * math.sqrt(155) and abs(middle - 1191) < 4 * math.sqrt(1191)
    assert curve.expected(60.0) == pytest.approx(155, abs=1)
    assert curve.expected(330.0) - curve.expected(270.0) == pytest.approx(1191, abs=1)


def test_the_cli_json_has_every_figure(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--nodes", "4", "--window-s", "120", "--node-add-s", "10", "--replica-start-s", "5", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["delays"] == {"node_add_s": 10.0, "replica_start_s": 5.0, "decision_to_serving_s": 15.0}
    assert "cos" in figures["curves"]["4"]["describe"]
    fixed, auto = figures["runs"]
    assert (fixed["fleet"], auto["fleet"]) == ("fixed", "autoscaled")
    for r in (fixed, auto):
        for key in ("goodput_rps", "attainment", "num_refused", "num_lost", "num_unfinished", "node_hours",
                    "met_per_node_hour", "num_scale_ups", "num_scale_downs", "peak_nodes", "wall_s"):
            assert key in r, key
        assert r["goodput_rps"] == r["num_met"] / 120 and r["num_lost"] == 0
        assert r["met_per_node_hour"] == r["num_met"] / r["node_hours"]
    assert fixed["node_hours"] == 4 * fixed["sim_end_s"] / 3600 and fixed["peak_nodes"] == 4
    assert auto["min_per_role"] == 1 and 2 <= auto["peak_nodes"] <= 4 and auto["node_hours"] < fixed["node_hours"]
