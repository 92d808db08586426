"""`python -m bench.sim`: goodput of three control planes on real traces at cluster scale.

Mental model: for each trace, replay it time-scaled to a grid of rates under each policy
(`policies.py`) on the simulated cluster (`cluster.py`, 16 prefill + 16 decode H200s running an
8B model by default; 32 colocated engines for the colocated baseline, so every policy gets the
same GPUs), measure SLO attainment, then refine each policy's goodput (the highest rate at which
>= 90% of requests meet both TTFT and TPOT) by bisection between its last passing and first
failing grid rate. Then inject failures (a prefill and a decode instance, or two colocated ones)
at a rate all policies sustain and measure recovery, and time the scheduler's decisions with 10k
requests in flight. A table goes to stdout (or the same figures as JSON with `--json`), PNG plots
of attainment vs rate to `--plot-dir`, progress to stderr. Runs go to `--jobs` processes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import multiprocessing
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.common import bench_parser, format_table, progress, run
from bench.sim.cluster import ClusterSpec, SimCluster
from bench.sim.hardware import ProfileCost, RooflineCost, StepCost
from bench.sim.latency import measure_decision_latency
from bench.sim.metrics import summarize
from bench.sim.policies import ColocatedRoundRobin, DisaggLoadOnly, Ours, SimPolicy
from bench.sim.request import SimRequest
from bench.sim.traces import MOONCAKE_BLOCK_TOKENS, load_azure_conv, load_mooncake, native_rate, scale_to_rate
from cluster.config import SchedulerConfig
from cluster.descriptors import TenantId
from cluster.placement import PlacementConfig
from cluster.tenants import InteractiveSlo, TenantConfig

POLICIES = ("colocated", "load-only", "ours")
GOODPUT_ATTAINMENT = 0.9
MAX_MODEL_LEN = 131072  # Llama-3.1-8B's context
MAX_TOKENS = 2048  # what clients ask for; the scheduler never sees the true output length


@dataclass(frozen=True, slots=True)
class TraceSetup:
    """SLOs (P99 targets) chosen before any run, from the workload: chat on an 8B model (1 s to
    first token, 50 ms per token = 20 tokens/s, faster than reading) and long-document work
    (Mooncake: 10 s to first token for ~15k-token prompts, 100 ms per token, the tightest TBT
    its paper uses)."""

    name: str
    num_requests: int | None  # None: the whole trace
    rates: tuple[float, ...]
    ttft_ms: float
    tpot_ms: float


# Whole traces: at a few hundred requests/s, Azure's first 4000 requests last ~7 s, about the
# TTFT slack, so a short window measures how big a burst a cluster absorbs more than the rate it
# sustains (colocated FCFS met 90% at ~650 req/s on 4000 requests and at ~400 on all 19,366).
TRACES = {
    "azure_conv": TraceSetup("azure_conv", None, (100, 200, 300, 400, 500, 600, 800, 1000), 1000.0, 50.0),
    "mooncake": TraceSetup("mooncake", None, (5, 10, 15, 20, 30, 40, 60, 80), 10000.0, 100.0),
}


@dataclass(frozen=True, slots=True)
class Job:
    trace: TraceSetup
    policy: str
    rate: float
    num_prefill: int = 16
    num_decode: int = 16
    failures: bool = False
    profile: str | None = None
    profile_scale: float = 1.0
    local_prefill: bool = True


@functools.lru_cache(maxsize=4)
def _trace(name: str, num_requests: int | None) -> tuple[Any, ...]:
    reqs = load_azure_conv(num_requests) if name == "azure_conv" else load_mooncake(num_requests)
    limit = MAX_MODEL_LEN - MAX_TOKENS
    clipped = []
    for r in reqs:  # a few Mooncake prompts exceed the model's context: keep their head
        if r.prompt_len > limit:
            r = replace(r, prompt_len=limit, block_hashes=r.block_hashes[: limit // MOONCAKE_BLOCK_TOKENS])
        clipped.append(r)
    return tuple(clipped)


def _router(job: Job) -> SimPolicy:
    if job.policy == "colocated":
        return ColocatedRoundRobin()
    if job.policy == "load-only":
        return DisaggLoadOnly()
    net = ClusterSpec().network
    slo = InteractiveSlo(ttft_ms=job.trace.ttft_ms, tpot_ms=job.trace.tpot_ms)
    cfg = SchedulerConfig(
        default_tenant=TenantConfig(TenantId("default"), slo=slo),
        placement=PlacementConfig(hash_block_size=MOONCAKE_BLOCK_TOKENS,
                                  pool_fetch_s_per_block=MOONCAKE_BLOCK_TOKENS * 131072 / net.pool_bytes_per_s,
                                  local_prefill=job.local_prefill),
        admission=replace(SchedulerConfig().admission, max_model_len=MAX_MODEL_LEN),
        heartbeat_timeout_s=ClusterSpec().heartbeat_timeout_s)
    return Ours(cfg, max_tokens=MAX_TOKENS)


def _cost(job: Job) -> StepCost:
    return ProfileCost(job.profile, job.profile_scale) if job.profile else RooflineCost()


def run_job(job: Job) -> dict[str, Any]:
    t0 = time.perf_counter()
    trace = scale_to_rate(list(_trace(job.trace.name, job.trace.num_requests)), job.rate)
    reqs = [SimRequest(f"r{i}", "default", t.arrival_s, t.prompt_len, t.output_len, t.block_hashes)
            for i, t in enumerate(trace)]
    span = trace[-1].arrival_s if trace else 0.0
    colocated = job.policy == "colocated"
    failures: tuple[tuple[float, str], ...] = ()
    if job.failures:
        failures = ((0.4 * span, "c"), (0.6 * span, "c")) if colocated else ((0.4 * span, "p"), (0.6 * span, "d"))
    spec = ClusterSpec(num_prefill=0 if colocated else job.num_prefill, num_decode=0 if colocated else job.num_decode,
                       num_colocated=job.num_prefill + job.num_decode if colocated else 0, failures=failures)
    router = _router(job)
    sim = SimCluster(spec, router, _cost(job))
    gc.freeze()  # the trace and requests live all run long: keep them out of full collections
    sim.run(reqs)
    out = summarize(reqs, job.trace.ttft_ms / 1e3, job.trace.tpot_ms / 1e3)
    out.update(trace=job.trace.name, policy=job.policy, rate=job.rate, failures=job.failures,
               wall_s=time.perf_counter() - t0, sim_events=sim.loop.num_events)
    if isinstance(router, Ours):
        st = router.sched.stats()
        out["decision_p50_us"], out["decision_p99_us"] = st.decision_p50_us, st.decision_p99_us
        out["refusals"] = st.num_refused
        started = [r for r in reqs if r.prefill_inst is not None and r.first_token_t is not None]
        # requests whose (last) prefill ran on the decode instance that decoded them
        out["local_prefill_fraction"] = sum(r.prefill_inst == r.decode_inst for r in started) / max(1, len(started))
    return out


def _map(jobs: list[Job], n_proc: int) -> list[dict[str, Any]]:
    if n_proc <= 1:
        return [run_job(j) for j in jobs]
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(n_proc) as pool:
        return pool.map(run_job, jobs, chunksize=1)


def goodput(points: dict[float, float]) -> float:
    """Highest rate whose attainment is >= 90%, given {rate: attainment}; 0 if none."""
    ok = [r for r, a in points.items() if a >= GOODPUT_ATTAINMENT]
    return max(ok) if ok else 0.0


def _bracket(points: dict[float, float]) -> tuple[float, float] | None:
    rates = sorted(points)
    for lo, hi in zip(rates, rates[1:]):
        if points[lo] >= GOODPUT_ATTAINMENT and points[hi] < GOODPUT_ATTAINMENT:
            return lo, hi
    if rates and points[rates[0]] < GOODPUT_ATTAINMENT:
        return 0.0, rates[0]
    return None


def evaluate_trace(setup: TraceSetup, args: argparse.Namespace) -> dict[str, Any]:
    base = Job(setup, "", 0.0, args.prefill, args.decode, False, args.profile, args.profile_scale,
               args.local_prefill)
    runs = _map([replace(base, policy=p, rate=r) for p in args.policies for r in setup.rates], args.jobs)
    points = {p: {r["rate"]: r["attainment"] for r in runs if r["policy"] == p} for p in args.policies}
    for it in range(args.refine):
        jobs = []
        for p in args.policies:
            b = _bracket(points[p])
            if b is not None and b[1] - b[0] > 1e-9:
                jobs.append(replace(base, policy=p, rate=round((b[0] + b[1]) / 2, 3)))
        progress(f"{setup.name}: refinement {it + 1}: {len(jobs)} runs")
        for r in _map(jobs, args.jobs):
            runs.append(r)
            points[r["policy"]][r["rate"]] = r["attainment"]
    good = {p: goodput(points[p]) for p in args.policies}
    at_goodput = {p: next((r for r in runs if r["policy"] == p and r["rate"] == good[p]), None) for p in args.policies}
    result: dict[str, Any] = {
        "slo": {"ttft_ms": setup.ttft_ms, "tpot_ms": setup.tpot_ms},
        "num_requests": len(_trace(setup.name, setup.num_requests)),
        "native_rate_rps": native_rate(list(_trace(setup.name, setup.num_requests))),
        "goodput_rps": good, "at_goodput": at_goodput,
        "attainment": {p: dict(sorted(points[p].items())) for p in args.policies},
        "runs": runs,
    }
    if args.failures:
        sustained = [g for g in good.values() if g > 0]
        rate = round(0.7 * min(sustained), 3) if sustained else setup.rates[0]
        progress(f"{setup.name}: failure injection at {rate} req/s")
        fails = _map([replace(base, policy=p, rate=rate, failures=True) for p in args.policies], args.jobs)
        result["failures"] = {"rate_rps": rate, "by_policy": {r["policy"]: r for r in fails}}
    return result


def render(figures: dict[str, Any]) -> str:
    out = []
    for name, tr in figures["traces"].items():
        g = tr["goodput_rps"]
        rows = []
        for p in g:
            at = tr["at_goodput"][p] or {}
            rows.append([p, g[p], g[p] / g["colocated"] if g.get("colocated") else None,
                         g[p] / g["load-only"] if g.get("load-only") else None,
                         at.get("attainment"), _ms(at.get("ttft_p99_s")), _ms(at.get("tpot_p99_s")),
                         at.get("prefix_cached_fraction")])
        slo = tr["slo"]
        out.append(format_table(
            ["policy", "goodput req/s", "x colocated", "x load-only", "attain@goodput", "P99 TTFT ms",
             "P99 TPOT ms", "prefix-cached"], rows,
            title=f"{name}: {tr['num_requests']} requests, SLO P99 TTFT {slo['ttft_ms']:.0f} ms / TPOT "
                  f"{slo['tpot_ms']:.0f} ms, native rate {tr['native_rate_rps']:.1f} req/s (time-scaled)"))
        att = {p: {float(r): a for r, a in pts.items()} for p, pts in tr["attainment"].items()}  # JSON keys: str
        rates = sorted({r for pts in att.values() for r in pts})
        out.append(format_table(["rate req/s"] + list(att), [[r] + [att[p].get(r) for p in att] for r in rates],
                                title=f"{name}: SLO attainment by rate"))
        if "failures" in tr:
            frows = []
            for p, r in tr["failures"]["by_policy"].items():
                rec = r.get("recovery") or {}
                frows.append([p, r["attainment"], _ms(r["ttft_p99_s"]), _ms(r["tpot_p99_s"]), rec.get("num_affected"),
                              rec.get("affected_attainment"), _ms(rec.get("next_token_gap_p50_s")),
                              _ms(rec.get("next_token_gap_max_s"))])
            out.append(format_table(
                ["policy", "attainment", "P99 TTFT ms", "P99 TPOT ms", "affected", "affected attain",
                 "recovery p50 ms", "recovery max ms"], frows,
                title=f"{name}: the busiest prefill, then decode instance killed (colocated: two busiest engines) at 40%/60% "
                      f"of the run, {tr['failures']['rate_rps']} req/s, detection after 1 s of missed reports"))
    lat = figures.get("decision_latency")
    if lat:
        cpu = lat["submit_cpu"]
        out.append(format_table(["in flight", "wall p50 us", "wall p99 us", "cpu p50 us", "cpu p99 us", "cpu max us"],
                                [[lat["num_in_flight"], lat["submit_p50_us"], lat["submit_p99_us"], cpu["p50_us"],
                                  cpu["p99_us"], cpu["max_us"]]],
                                title="scheduler decision latency (submit), 16 prefill + 16 decode workers"))
    text = "\n\n".join(out)
    if figures.get("plots"):
        text += "\n\nplots: " + ", ".join(figures["plots"])
    return text + f"\ntotal {figures['wall_s']:.0f} s"


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1e3


def bench(args: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {"cluster": {"prefill": args.prefill, "decode": args.decode,
                                           "colocated": args.prefill + args.decode,
                                           "cost": args.profile or "roofline H200 / Llama-3.1-8B",
                                           "ours_local_prefill": args.local_prefill},
                               "traces": {}}
    for name in [t for t in args.traces.split(",") if t]:
        setup = TRACES[name]
        setup = replace(setup, num_requests=args.requests or setup.num_requests,
                        rates=tuple(float(r) for r in args.rates.split(",")) if args.rates else setup.rates,
                        ttft_ms=args.ttft_ms or setup.ttft_ms, tpot_ms=args.tpot_ms or setup.tpot_ms)
        progress(f"{name}: {len(args.policies)} policies x {len(setup.rates)} rates")
        figures["traces"][name] = evaluate_trace(setup, args)
    if args.latency:
        progress("decision latency with 10k requests in flight")
        figures["decision_latency"] = measure_decision_latency(local_prefill=args.local_prefill)
    if args.plot_dir:
        figures["plots"] = plot_attainment(figures, Path(args.plot_dir))
    return figures


def plot_attainment(figures: dict[str, Any], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, tr in figures["traces"].items():
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for policy, points in tr["attainment"].items():
            rates = sorted(points)
            ax.plot(rates, [points[r] for r in rates], marker="o", label=f"{policy} (goodput {tr['goodput_rps'][policy]:g})")
        ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
        slo = tr["slo"]
        ax.set_title(f"{name}: TTFT {slo['ttft_ms']:.0f} ms, TPOT {slo['tpot_ms']:.0f} ms (P99 targets)")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("fraction meeting both SLOs")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left", fontsize=8)
        path = out_dir / f"attainment_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(str(path))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--traces", default="azure_conv,mooncake", help="comma list of: " + ", ".join(TRACES))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--prefill", type=int, default=16)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--requests", type=int, default=None, help="requests per trace (default: per trace)")
    ap.add_argument("--rates", default=None, help="comma list of req/s overriding every trace's grid")
    ap.add_argument("--ttft-ms", type=float, default=None)
    ap.add_argument("--tpot-ms", type=float, default=None)
    ap.add_argument("--refine", type=int, default=2, help="bisection steps per policy after the grid")
    ap.add_argument("--no-failures", dest="failures", action="store_false")
    ap.add_argument("--no-latency", dest="latency", action="store_false")
    ap.add_argument("--no-local-prefill", dest="local_prefill", action="store_false",
                    help="ours without decode workers prefilling for themselves (a fixed P/D split)")
    ap.add_argument("--profile", default=None, help="JSON step-time profile replacing the H200 roofline")
    ap.add_argument("--profile-scale", type=float, default=1.0)
    ap.add_argument("--plot-dir", default="/tmp/ferry-sim", help="where PNG plots go ('' for none)")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    run(bench, args, render)
    return 0
