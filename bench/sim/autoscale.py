"""`python -m bench.sim.autoscale`: a day of load on a fixed fleet vs the project's autoscaler.

Mental model: one node is one instance. The scheduler in the simulation is the real one (`Ours`),
configured with the serving defaults of `cluster/scaling.py`, and `Autoscaler` plays the part of
`deploy/scaler.py` plus the Ray autoscaler: every `interval_s` simulated seconds it asks
`GlobalScheduler.scale_advice()` (the real `ScaleAdvisor` fed by the real `prefill_pressure` /
`decode_pressure` of the workers that have reported healthy) for a replica count per role, and
- above the live + starting count: starts a node; the instance joins `node_add_s +
  replica_start_s` later (measured with real Ray nodes, bench/multinode.py: ~45-60 s from demand
  to node, ~35-60 s from node to a serving replica) and the scheduler learns of it from its
  first report, as it learns of any new worker;
- below: cancels a node still starting, else drains the least loaded live instance of the role:
  it reports itself unhealthy (the scheduler places nothing new there) and finishes what it
  holds; it is removed (and the scheduler told) only once nothing, physically or in the
  scheduler's journal, is on it, so a scale-down loses no request.
A node is paid for from the decision to start it until it is removed (node-hours).
The load is a compressed day: the trace's requests, lengths and order kept (cycled, each pass
with its own prefix hashes so repeats are not free cache hits), re-timed as a Poisson process
whose rate follows `DiurnalCurve`, a sinusoid from a trough to a peak sized to need most of the
fleet. Goodput is the requests meeting both SLOs (`bench.sim.run`'s targets) per second of the
window. Mooncake is the default trace: its long prompts bring few requests per node, so a
128-node day simulates in minutes (Azure's ~20x more, shorter requests cost ~8x more per node
second to simulate).
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from bench.common import bench_parser, csv, format_table, progress, run
from bench.sim.cluster import ClusterSpec, SimCluster
from bench.sim.metrics import summarize
from bench.sim.policies import Ours
from bench.sim.request import SimRequest
from bench.sim.run import MAX_TOKENS, TRACES, Job, TraceSetup, _router, _trace
from bench.sim.traces import TraceRequest
from cluster.scaling import RoleBounds, ScalingConfig

ROLES = ("p", "d")  # prefill and decode instance names start with these
# Requests/s one node (half a P/D pair) serves at ~90% SLO attainment, measured with `Ours` on
# 4 + 4 (Mooncake: 0.93 at 10 req/s) and 8 + 8 (Azure: 0.90 at 400 req/s) instances.
NODE_RPS = {"mooncake": 1.2, "azure_conv": 25.0}


@dataclass(frozen=True, slots=True)
class StartDelays:
    node_add_s: float = 50.0  # from the decision to a node up (Ray autoscaler period + node start)
    replica_start_s: float = 45.0  # from the node up to a replica serving on it

    @property
    def total_s(self) -> float:
        return self.node_add_s + self.replica_start_s


@dataclass(frozen=True, slots=True)
class DiurnalCurve:
    """rate(t) = low + (peak - low) (1 - cos(2 pi t / period)) / 2: trough at 0 and at the end of
    the window, peak halfway."""

    low_rps: float
    peak_rps: float
    period_s: float

    def rate(self, t: float) -> float:
        return self.low_rps + (self.peak_rps - self.low_rps) * (1 - math.cos(2 * math.pi * t / self.period_s)) / 2

    def expected(self, t: float) -> float:
        """Requests expected in [0, t]: the rate's integral."""
        w = 2 * math.pi / self.period_s
        return self.low_rps * t + (self.peak_rps - self.low_rps) / 2 * (t - math.sin(w * t) / w)

    def arrivals(self, seed: int = 0) -> list[float]:
        """A Poisson process of this rate over one period: unit exponential gaps in expected
        count, mapped back to time by Newton's method (the rate is the derivative, >= low > 0)."""
        rng = random.Random(seed)
        total = self.expected(self.period_s)
        out: list[float] = []
        t = due = 0.0
        while True:
            due += rng.expovariate(1.0)
            if due >= total:
                return out
            for _ in range(50):
                step = (self.expected(t) - due) / self.rate(t)
                t -= step
                if abs(step) < 1e-9:
                    break
            out.append(t)

    def describe(self) -> str:
        return (f"rate(t) = {self.low_rps:g} + ({self.peak_rps:g} - {self.low_rps:g}) (1 - cos(2 pi t / "
                f"{self.period_s:g} s)) / 2 req/s: trough {self.low_rps:g} at 0 and {self.period_s:g} s, "
                f"peak {self.peak_rps:g} at {self.period_s / 2:g} s")


def diurnal_requests(trace: Sequence[TraceRequest], curve: DiurnalCurve, seed: int = 0) -> list[SimRequest]:
    """The trace's requests in order (cycled as often as the day needs), arriving on `curve`.
    Pass k > 0 maps each prefix hash h to hash((k, h)): equal prefixes within a pass stay equal."""
    out = []
    for i, t in enumerate(curve.arrivals(seed)):
        k, src = i // len(trace), trace[i % len(trace)]
        hashes = src.block_hashes if k == 0 else tuple(hash((k, h)) for h in src.block_hashes)
        out.append(SimRequest(f"r{i}", "default", t, src.prompt_len, src.output_len, hashes))
    return out


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    t: float
    role: str  # "p" or "d"
    action: str  # start (node ordered), join (instance serving), cancel, drain, remove
    name: str | None = None  # the instance; None while its node is still starting


class Autoscaler:
    """Applies `policy`'s scale advice to `sim` every `interval_s`, with `delays` before a new
    instance serves. Build it before `sim.run`; it stops when the run has nothing pending."""

    def __init__(self, sim: SimCluster, policy: Ours, delays: StartDelays, interval_s: float = 1.0) -> None:
        assert policy.cfg.scaling is not None, "the scheduler needs a ScalingConfig to advise"
        self.sim, self.policy, self.delays, self.interval_s = sim, policy, delays, interval_s
        self.events: list[ScaleEvent] = []
        self.timeline: list[dict[str, float]] = []  # one sample a minute: nodes and pressures
        self._starting: dict[str, list[int]] = {r: [] for r in ROLES}
        self._ids = itertools.count()
        self._held, self._since, self._node_s = len(sim.instances), 0.0, 0.0
        self.peak_nodes = self._held
        sim.loop.after(interval_s, self._step)

    def serving(self, role: str) -> list[str]:
        """Live instances of `role` that take new work (not draining)."""
        return [n for n, inst in self.sim.instances.items()
                if n.startswith(role) and n not in self.sim.draining and not inst.dead]

    @property
    def num_held(self) -> int:
        """Nodes paid for now: serving, starting or draining."""
        return self._held

    def num_starting(self, role: str) -> int:
        return len(self._starting[role])

    def node_hours(self, until: float) -> float:
        return (self._node_s + self._held * (until - self._since)) / 3600.0

    def count(self, action: str) -> int:
        return sum(e.action == action for e in self.events)

    def _step(self) -> None:
        sim = self.sim
        if sim.num_pending == 0:
            return
        for name in sorted(sim.draining):
            if not sim.holds_work(name):
                sim.remove_instance(name)
                self._hold(-1)
                self._log(name[0], "remove", name)
        advice = self.policy.sched.scale_advice()
        assert advice is not None
        for role, want in (("p", advice.prefill), ("d", advice.decode)):
            have = len(self.serving(role)) + self.num_starting(role)
            for _ in range(want - have):
                self._start(role)
            for _ in range(have - want):
                self._stop_one(role)
        now = sim.loop.now
        if not self.timeline or now - self.timeline[-1]["t_s"] >= 60.0:
            self.timeline.append({"t_s": now, "prefill": len(self.serving("p")), "decode": len(self.serving("d")),
                                  "starting": self.num_starting("p") + self.num_starting("d"),
                                  "draining": len(sim.draining), "prefill_pressure": advice.prefill_pressure,
                                  "decode_pressure": advice.decode_pressure})
        sim.loop.after(self.interval_s, self._step)

    def _start(self, role: str) -> None:
        sid = next(self._ids)
        self._starting[role].append(sid)
        self._hold(+1)
        self._log(role, "start")
        self.sim.loop.after(self.delays.total_s, self._join, role, sid)

    def _join(self, role: str, sid: int) -> None:
        if sid not in self._starting[role]:
            return  # cancelled while its node started
        self._starting[role].remove(sid)
        self._log(role, "join", self.sim.add_instance(role))

    def _stop_one(self, role: str) -> None:
        if self._starting[role]:  # the newest start is the cheapest to give up
            self._starting[role].pop()
            self._hold(-1)
            self._log(role, "cancel")
            return
        live = self.serving(role)
        if len(live) <= 1:
            return
        name = min(live, key=lambda n: (sum(self.sim.instances[n].load()), n))
        self.sim.drain(name)
        self._log(role, "drain", name)

    def _hold(self, delta: int) -> None:
        now = self.sim.loop.now
        self._node_s += self._held * (now - self._since)
        self._held, self._since = self._held + delta, now
        self.peak_nodes = max(self.peak_nodes, self._held)

    def _log(self, role: str, action: str, name: str | None = None) -> None:
        self.events.append(ScaleEvent(self.sim.loop.now, role, action, name))


# ---- the benchmark ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetRun:
    """One day on `num_nodes` nodes: fixed (half prefill, half decode), or autoscaled between
    `min_fraction` of the nodes per role and half of them, starting at the minimum."""

    trace: TraceSetup
    curve: DiurnalCurve
    num_nodes: int
    autoscale: bool
    delays: StartDelays = field(default_factory=StartDelays)
    min_fraction: float = 0.125
    interval_s: float = 1.0
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.num_nodes} nodes, {'autoscaled' if self.autoscale else 'fixed'}"


def run_fleet(job: FleetRun) -> dict[str, Any]:
    t0 = time.perf_counter()
    reqs = diurnal_requests(_trace(job.trace.name, job.trace.num_requests), job.curve, job.seed)
    half = job.num_nodes // 2
    low = max(1, min(half, round(job.num_nodes * job.min_fraction)))
    scaling = ScalingConfig(prefill=RoleBounds(low, half), decode=RoleBounds(low, half)) if job.autoscale else None
    router = Ours(replace(_router(Job(job.trace, "ours", 0.0)).cfg, scaling=scaling), max_tokens=MAX_TOKENS)
    first = low if job.autoscale else half
    sim = SimCluster(ClusterSpec(num_prefill=first, num_decode=first), router)
    scaler = Autoscaler(sim, router, job.delays, job.interval_s) if job.autoscale else None
    progress(f"{job.label}: {len(reqs)} requests over {job.curve.period_s:g} s")
    _show_progress(sim, scaler, job, t0)
    sim.run(reqs)
    end = sim.loop.now
    out = summarize(reqs, job.trace.ttft_ms / 1e3, job.trace.tpot_ms / 1e3)
    node_hours = scaler.node_hours(end) if scaler is not None else job.num_nodes * end / 3600.0
    out.update(nodes=job.num_nodes, fleet="autoscaled" if job.autoscale else "fixed",
               goodput_rps=out["num_met"] / job.curve.period_s,
               num_lost=sum(r.num_losses > 0 for r in reqs), node_hours=node_hours,
               met_per_node_hour=out["num_met"] / node_hours if node_hours else 0.0,
               sim_end_s=end, wall_s=time.perf_counter() - t0, sim_events=sim.loop.num_events)
    if scaler is None:
        out.update(min_per_role=half, max_per_role=half, num_scale_ups=0, num_scale_downs=0, num_cancelled=0,
                   peak_nodes=job.num_nodes)
    else:
        out.update(min_per_role=low, max_per_role=half, num_scale_ups=scaler.count("start"),
                   num_scale_downs=scaler.count("drain"), num_cancelled=scaler.count("cancel"),
                   peak_nodes=scaler.peak_nodes, timeline=scaler.timeline,
                   events=[asdict(e) for e in scaler.events])
    return out


def _show_progress(sim: SimCluster, scaler: Autoscaler | None, job: FleetRun, t0: float) -> None:
    def show() -> None:
        nodes = len(sim.instances) if scaler is None else scaler.num_held
        progress(f"{job.label}: t = {sim.loop.now:.0f}/{job.curve.period_s:g} s, {nodes} nodes, "
                 f"{sim.num_pending} pending, wall {time.perf_counter() - t0:.0f} s")
        if sim.num_pending:
            sim.loop.after(job.curve.period_s / 6, show)

    sim.loop.at(job.curve.period_s / 6, show)


def _map(jobs: list[FleetRun], num_procs: int) -> list[dict[str, Any]]:
    if num_procs <= 1:
        return [run_fleet(j) for j in jobs]
    with multiprocessing.get_context("fork").Pool(num_procs) as pool:
        return pool.map(run_fleet, jobs, chunksize=1)


def curve_for(num_nodes: int, args: argparse.Namespace) -> DiurnalCurve:
    peak = args.peak_fill * num_nodes * (args.node_rps or NODE_RPS[args.trace])
    return DiurnalCurve(round(args.trough * peak, 3), round(peak, 3), args.window_s)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    setup = TRACES[args.trace]
    delays = StartDelays(args.node_add_s, args.replica_start_s)
    jobs = [FleetRun(setup, curve_for(n, args), n, auto, delays, args.min_fraction, args.interval_s, args.seed)
            for n in args.nodes for auto in (False, True)]
    runs = _map(jobs, args.jobs)
    return {"trace": setup.name, "window_s": args.window_s,
            "slo": {"ttft_ms": setup.ttft_ms, "tpot_ms": setup.tpot_ms},
            "delays": {"node_add_s": delays.node_add_s, "replica_start_s": delays.replica_start_s,
                       "decision_to_serving_s": delays.total_s},
            "scaling": {k: v for k, v in asdict(ScalingConfig()).items() if k not in ("prefill", "decode")},
            "curves": {str(n): {**asdict(curve_for(n, args)), "describe": curve_for(n, args).describe()}
                       for n in args.nodes},
            "runs": runs}


def render(figures: dict[str, Any]) -> str:
    rows = []
    for r in figures["runs"]:
        rows.append([r["nodes"], r["fleet"], f"{r['min_per_role']}-{r['max_per_role']}", r["goodput_rps"],
                     r["attainment"], r["num_refused"], r["num_unfinished"], r["num_lost"], r["node_hours"],
                     r["met_per_node_hour"], r["num_scale_ups"], r["num_scale_downs"], r["peak_nodes"],
                     _ms(r["ttft_p99_s"]), _ms(r["tpot_p99_s"]), r["wall_s"]])
    d, slo = figures["delays"], figures["slo"]
    title = (f"{figures['trace']}: one day compressed into {figures['window_s']:g} simulated s; SLO P99 TTFT "
             f"{slo['ttft_ms']:.0f} ms / TPOT {slo['tpot_ms']:.0f} ms; a new node serves {d['decision_to_serving_s']:g} s "
             f"after the advice (node add {d['node_add_s']:g} s + replica start {d['replica_start_s']:g} s); "
             f"ScaleAdvisor {figures['scaling']}")
    table = format_table(["nodes", "fleet", "per role", "goodput req/s", "attainment", "refused", "unfinished",
                          "lost", "node-h", "good req/node-h", "ups", "downs", "peak nodes", "P99 TTFT ms",
                          "P99 TPOT ms", "wall s"], rows, title=title)
    curves = "\n".join(f"{n} nodes: {c['describe']}" for n, c in figures["curves"].items())
    return f"{table}\n\n{curves}\ntotal {figures['wall_s']:.0f} s"


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--nodes", type=csv(int), default=[32, 128], help="fleet sizes (comma list)")
    ap.add_argument("--node-add-s", type=float, default=50.0)
    ap.add_argument("--replica-start-s", type=float, default=45.0)
    ap.add_argument("--trace", default="mooncake", choices=sorted(TRACES))
    ap.add_argument("--window-s", type=float, default=1800.0, help="simulated seconds one day is compressed into")
    ap.add_argument("--node-rps", type=float, default=None, help="req/s one node serves (default: per trace)")
    ap.add_argument("--peak-fill", type=float, default=0.8, help="peak rate as a fraction of what N nodes serve")
    ap.add_argument("--trough", type=float, default=0.25, help="trough rate as a fraction of the peak")
    ap.add_argument("--min-fraction", type=float, default=0.125, help="autoscaler minimum per role, of N")
    ap.add_argument("--interval-s", type=float, default=1.0, help="how often the advice is applied")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    args = ap.parse_args(argv)
    if any(n < 2 for n in args.nodes):
        ap.error("--nodes: at least 2 (one prefill and one decode node)")
    run(bench, args, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
