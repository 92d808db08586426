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


def voluntary_switches(p: psutil.Process) -> int:
    """Times all of `p`'s threads went to sleep (psutil's count is the main thread's only)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{p.pid}/task")
    except OSError:  # not Linux: the main thread's
        return p.num_ctx_switches().voluntary
    for tid in tasks:
        try:
            with open(f"/proc/{p.pid}/task/{tid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (OSError, StopIteration, ValueError):  # a thread that just ended
            pass
    return total


def sample(procs: list[psutil.Process]) -> dict[int, CpuSample]:
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = CpuSample(t.user + t.system, voluntary_switches(p))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


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
        start = before.get(p.pid, CpuSample(0.0, 0))
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
        })
    rows.sort(key=lambda r: -r["cpu_pct_of_core"])
    return rows


def summarize(rows: list[dict[str, Any]], window_s: float) -> Figures:
    total = sum(r["cpu_pct_of_core"] for r in rows)
    return {"window_s": window_s, "processes": rows, "total_cpu_pct_of_core": total,
            "budget_pct_of_core": BUDGET_PCT, "within_budget": total <= BUDGET_PCT}


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
    figures = summarize(rows, args.window)
    figures.update(config=args.config, model=cfg.model, warmup=args.warmup, settle_s=args.settle, startup_s=started_s)
    return figures


def render(f: Figures) -> str:
    rows = [(r["pid"], r["role"], r["cpu_pct_of_core"], r["wakeups_per_s"], r["threads"]) for r in f["processes"]]
    rows.append(("", "total", f["total_cpu_pct_of_core"], sum(r["wakeups_per_s"] for r in f["processes"]), ""))
    verdict = "within" if f["within_budget"] else "OVER"
    title = (f"idle app ({f.get('config', '?')}), {f['window_s']:g} s window: "
             f"{f['total_cpu_pct_of_core']:.2f}% of one core, {verdict} the {f['budget_pct_of_core']:g}% budget")
    return format_table(["pid", "process", "% of one core", "wake-ups/s", "threads"], rows, title=title)


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
