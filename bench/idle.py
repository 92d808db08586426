"""What an idle ferry costs: CPU per process of the default app while no request arrives.

Mental model: start the app the way `ferry serve --config deploy/serve.yaml` does (a local Ray
cluster on loopback with its dashboard, Serve's proxy, the app from `deploy.apps.build_app`), wait
for `/health` to say healthy, send one warm-up request (unless `--no-warmup`), let it settle, then
read every process this one started (its descendants: gcs_server, raylet, the dashboard and its
agent, Ray workers, the Serve controller and proxy, the replicas and actors) twice, `--window` s
apart, with psutil. A process's figure is its CPU seconds (user + system) in the window over the
window: the share of ONE core it used. Voluntary context switches per second count how often it
woke up, the cause behind most idle CPU. Roles come from the Ray process titles
(`ray::ServeReplica:ferry:decode`, `ray::ServeController`, `ray::SchedulerService`, ...). The budget (issue 38): all of it together at most 2% of one core.

The floor, measured in the same window: one bare async Ray actor (no methods called, nothing
running) started beside the app. Every Ray worker process pays it, whatever runs in it: Ray
2.60's task-execution loop wakes every 10 ms (a fixed `CoreWorker.CheckSignal` timer) to take
the GIL and check for signals. `floor_pct_of_core` = that actor's share x the app's Ray worker
processes (replicas, actors, Serve's controller and proxy); each worker's `above_floor` is what
its own code and threads add. The bare actor is not counted in the app's total.

    python -m bench.idle [--config deploy/serve.yaml] [--window 20] [--settle 10] [--no-warmup] [--json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import psutil

from bench.common import Figures, bench_parser, format_table, free_port, progress, run, stdout_to_stderr, wait_healthy

BUDGET_PCT = 2.0  # of one core, the whole idle app (issue 38)
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "serve.yaml")

# A process title or command line -> its role, first match wins (Ray names its workers `ray::<what>`).
ROLES: tuple[tuple[str, str], ...] = (
    ("gcs_server", "Ray GCS"),
    ("raylet", "Ray raylet"),
    ("dashboard/agent.py", "Ray dashboard agent"),
    ("runtime_env/agent/main.py", "Ray runtime-env agent"),
    ("dashboard/dashboard.py", "Ray dashboard"),
    ("ray-dashboard-", "Ray dashboard module"),
    ("log_monitor.py", "Ray log monitor"),
    ("monitor.py", "Ray autoscaler monitor"),
    ("ray::DashboardAgent", "Ray dashboard agent"),  # Ray's own agents, not workers running tasks
    ("ray::RuntimeEnvAgent", "Ray runtime-env agent"),
    ("ray::ServeController", "Serve controller"),
    ("ray::ProxyActor", "Serve proxy"),
    ("ray::ServeReplica:", "Serve replica"),
    ("ray::IDLE", "Ray idle worker"),
    ("ray::", "Ray actor"),
)


@dataclass(frozen=True)
class CpuSample:
    cpu_s: float  # user + system seconds so far
    voluntary_switches: int
    thread_cpu_s: dict[str, float]  # by thread name (threads of one name summed)


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def role_of(cmdline: str) -> str:
    """The readable role of a process from its command line: Ray titles its workers
    `ray::<class>[.<method running>]`, Serve replicas `ray::ServeReplica:<app>:<deployment>`."""
    if "ray::ServeReplica:" in cmdline:
        title = cmdline.split("ray::ServeReplica:", 1)[1].split()[0]
        return f"Serve replica {title.split(':')[-1].split('.')[0]}"
    for needle, role in ROLES:
        if needle in cmdline:
            if role == "Ray actor":
                return f"actor {cmdline.split('ray::', 1)[1].split()[0].split('.')[0]}"
            if role == "Ray dashboard module":  # ray-dashboard-<Module>Head-0 (...)
                return f"{role} {cmdline.split(needle, 1)[1].split()[0].rsplit('-', 1)[0]}"
            return role
    return f"other: {cmdline[:60]}"


def thread_figures(p: psutil.Process) -> tuple[int, dict[str, float]]:
    """Times all of `p`'s threads went to sleep (psutil's count is the main thread's only), and
    CPU seconds by thread name (from /proc; empty where there is no /proc)."""
    switches, by_name = 0, {}
    try:
        tasks = os.listdir(f"/proc/{p.pid}/task")
    except OSError:  # not Linux: the main thread's
        return p.num_ctx_switches().voluntary, by_name
    for tid in tasks:
        try:
            with open(f"/proc/{p.pid}/task/{tid}/status") as f:
                switches += next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
            with open(f"/proc/{p.pid}/task/{tid}/stat") as f:
                stat = f.read()
        except (OSError, StopIteration, ValueError):  # a thread that just ended
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        by_name[name] = by_name.get(name, 0.0) + (int(rest[11]) + int(rest[12])) * _TICK_S  # utime + stime
    return switches, by_name


def sample(procs: list[psutil.Process]) -> dict[int, CpuSample]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            switches, threads = thread_figures(p)
            out[p.pid] = CpuSample(t.user + t.system, switches, threads)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def busiest_threads(before: CpuSample, after: CpuSample, window_s: float, n: int = 3) -> list[tuple[str, float]]:
    """The `n` thread names that used the most CPU in the window, with their % of one core."""
    used = {k: 100.0 * (v - before.thread_cpu_s.get(k, 0.0)) / window_s for k, v in after.thread_cpu_s.items()}
    return sorted(((k, round(v, 2)) for k, v in used.items() if v > 0), key=lambda kv: -kv[1])[:n]


def app_processes(root: psutil.Process) -> list[psutil.Process]:
    """`root` (the driver: this process) and every process it started, recursively."""
    return [root, *root.children(recursive=True)]


def measure(root: psutil.Process, window_s: float) -> list[dict[str, Any]]:
    """One row per process alive at the window's end: pid, role, % of one core, wake-ups/s (all
    its threads), threads; busiest first. A process started during the window counts from its start."""
    procs = app_processes(root)
    before = sample(procs)
    time.sleep(window_s)
    procs = app_processes(root)
    after = sample(procs)
    rows = []
    for p in procs:
        if p.pid not in after:
            continue
        start = before.get(p.pid, CpuSample(0.0, 0, {}))
        try:
            cmdline = " ".join(p.cmdline()) or p.name()
            threads = p.num_threads()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        role = "driver (bench)" if p.pid == root.pid else role_of(cmdline)
        rows.append({
            "pid": p.pid,
            "role": role,
            "cpu_pct_of_core": 100.0 * (after[p.pid].cpu_s - start.cpu_s) / window_s,
            "wakeups_per_s": (after[p.pid].voluntary_switches - start.voluntary_switches) / window_s,
            "threads": threads,
            "busiest_threads": busiest_threads(start, after[p.pid], window_s),
        })
    rows.sort(key=lambda r: -r["cpu_pct_of_core"])
    return rows


WORKER_ROLES = ("Serve replica ", "actor ", "Serve controller", "Serve proxy")  # Ray worker processes


def summarize(rows: list[dict[str, Any]], window_s: float, bare_pid: int | None = None) -> Figures:
    """The app's total (the bare actor `bare_pid` left out, but kept as the floor per worker)."""
    bare = next((r for r in rows if r["pid"] == bare_pid), None)
    rows = [r for r in rows if r["pid"] != bare_pid]
    total = sum(r["cpu_pct_of_core"] for r in rows)
    f: Figures = {"window_s": window_s, "processes": rows, "total_cpu_pct_of_core": total,
                  "budget_pct_of_core": BUDGET_PCT, "within_budget": total <= BUDGET_PCT}
    if bare is not None:
        workers = [r for r in rows if r["role"].startswith(WORKER_ROLES)]
        for r in workers:
            r["above_floor"] = r["cpu_pct_of_core"] - bare["cpu_pct_of_core"]
        f.update(bare_actor_pct_of_core=bare["cpu_pct_of_core"], num_ray_workers=len(workers),
                 floor_pct_of_core=bare["cpu_pct_of_core"] * len(workers))
    return f


def _bare_actor() -> tuple[Any, int]:
    """A Ray actor that does nothing, on the app's cluster: the per-process floor. Async, as Serve
    replicas are; no CPU reserved, so it always fits."""
    import ray

    @ray.remote(num_cpus=0)
    class BareActor:
        async def pid(self) -> int:
            return os.getpid()

    actor = BareActor.remote()  # type: ignore[attr-defined]
    return actor, ray.get(actor.pid.remote(), timeout=120)


def _warm_up(url: str, model: str) -> None:
    import httpx2

    body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 8}
    r = httpx2.post(f"{url}/v1/chat/completions", json=body, timeout=300, trust_env=False)
    r.raise_for_status()


def bench(args: argparse.Namespace) -> Figures:
    with stdout_to_stderr():
        return _bench(args)


def _bench(args: argparse.Namespace) -> Figures:
    from deploy.local import loopback_env

    loopback_env()  # before ray is imported, as `ferry serve` does
    # The dashboard's and the autoscaler's own metrics ports are fixed (44227, 44217): another Ray
    # cluster on this machine (a test run) would make this dashboard fail to start. Free ones instead.
    for env in ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT"):
        os.environ.setdefault(env, str(free_port()))
    from ray import serve

    from deploy.apps import build_app
    from deploy.config import load_config, read_args
    from deploy.local import start_local

    raw = read_args(args.config)
    if args.model:
        raw["model"] = args.model
    cfg = load_config(raw)
    progress(f"starting the app of {args.config} ({cfg.mode}, {cfg.model}) on 127.0.0.1:{args.port} ...")
    urls = start_local(http_port=args.port, dashboard_port=args.dashboard_port, metrics_port=args.metrics_port)
    try:
        t0 = time.perf_counter()
        serve.run(build_app(raw), name="ferry", route_prefix="/", blocking=False,
                  external_scaler_enabled=cfg.workers_as == "deployments")
        wait_healthy(urls.api, args.startup_timeout)
        started_s = time.perf_counter() - t0
        progress(f"healthy after {started_s:.0f} s")
        if args.warmup:
            _warm_up(urls.api, cfg.model)
            progress("warm-up request answered")
        _floor_actor, bare_pid = _bare_actor()  # kept referenced: it lives until the app stops
        progress(f"settling {args.settle:g} s, then measuring {args.window:g} s ...")
        time.sleep(args.settle)
        rows = measure(psutil.Process(), args.window)
    finally:
        progress("stopping the app")
        try:
            serve.shutdown()
        finally:
            import ray

            ray.shutdown()
    figures = summarize(rows, args.window, bare_pid)
    figures.update(config=args.config, model=cfg.model, warmup=args.warmup, settle_s=args.settle, startup_s=started_s)
    return figures


def render(f: Figures) -> str:
    rows = [(r["pid"], r["role"], r["cpu_pct_of_core"], r.get("above_floor", ""), r["wakeups_per_s"], r["threads"],
             " ".join(f"{name}:{pct:g}" for name, pct in r.get("busiest_threads", ())))
            for r in f["processes"]]
    rows.append(("", "total", f["total_cpu_pct_of_core"], "", sum(r["wakeups_per_s"] for r in f["processes"]),
                 "", ""))
    verdict = "within" if f["within_budget"] else "OVER"
    title = (f"idle app ({f.get('config', '?')}), {f['window_s']:g} s window: "
             f"{f['total_cpu_pct_of_core']:.2f}% of one core, {verdict} the {f['budget_pct_of_core']:g}% budget")
    if "floor_pct_of_core" in f:
        title += (f"; Ray's floor: a bare actor {f['bare_actor_pct_of_core']:.2f}% x {f['num_ray_workers']} "
                  f"worker processes = {f['floor_pct_of_core']:.2f}%")
    return format_table(["pid", "process", "% of one core", "above floor", "wake-ups/s", "threads",
                         "busiest threads (%)"], rows, title=title)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, model=None)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the app's YAML (default deploy/serve.yaml)")
    p.add_argument("--window", type=float, default=20.0, help="seconds CPU time is measured over")
    p.add_argument("--settle", type=float, default=10.0, help="seconds to wait after the warm-up before measuring")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="send one short greedy chat request first (default on)")
    p.add_argument("--port", type=int, default=18000, help="the API's port (not 8000: a running ferry may have it)")
    p.add_argument("--dashboard-port", type=int, default=18265)
    p.add_argument("--metrics-port", type=int, default=18080)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.window <= 0 or args.settle < 0:
        p.error("--window must be positive and --settle non-negative")
    run(bench, args, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
