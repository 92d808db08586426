"""bench/idle.py's measurement and figures, on this process and a child it starts (the whole app
takes a minute to start here, so the end-to-end run is not a test): every descendant is listed
with a role, its share of one core and its wake-ups, and the JSON has the documented shape."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil

from bench import idle


def test_figures_cover_every_descendant_and_round_trip_as_json() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time() + 30\nwhile time.time() < t: pass"])
    try:
        rows = idle.measure(psutil.Process(), window_s=0.5)
    finally:
        child.kill()
        child.wait()
    pids = {r["pid"] for r in rows}
    assert child.pid in pids and psutil.Process().pid in pids
    for r in rows:
        assert set(r) == {"pid", "role", "cpu_pct_of_core", "wakeups_per_s", "threads", "busiest_threads"}
        assert r["cpu_pct_of_core"] >= 0 and r["wakeups_per_s"] >= 0 and r["threads"] >= 1
    # The spinning child's one thread is named with the CPU it used (clock ticks: coarse, but > 0).
    spinning = next(r for r in rows if r["pid"] == child.pid)
    assert spinning["busiest_threads"] and spinning["busiest_threads"][0][1] > 0
    assert next(r for r in rows if r["pid"] == psutil.Process().pid)["role"] == "driver (bench)"
    figures = json.loads(json.dumps(idle.summarize(rows, 0.5)))
    assert set(figures) == {"window_s", "processes", "total_cpu_pct_of_core", "budget_pct_of_core", "within_budget"}
    assert figures["total_cpu_pct_of_core"] == sum(r["cpu_pct_of_core"] for r in rows)
    assert figures["within_budget"] == (figures["total_cpu_pct_of_core"] <= idle.BUDGET_PCT)
    assert "% of one core" in idle.render(figures) and "busiest threads" in idle.render(figures)


def test_roles_come_from_ray_process_titles() -> None:
    assert idle.role_of("ray::ServeReplica:ferry:decode.handle_request") == "Serve replica decode"
    assert idle.role_of("ray::SchedulerService.report") == "actor SchedulerService"
    assert idle.role_of("ray::ServeController") == "Serve controller"
    assert idle.role_of("/x/ray/core/src/ray/gcs/gcs_server --port=1") == "Ray GCS"
    assert idle.role_of("ray-dashboard-NodeHead-0 (/x/python -B -c ...)") == "Ray dashboard module NodeHead"
    assert idle.role_of("/usr/bin/python other.py").startswith("other: ")


def test_the_bare_actor_is_the_floor_not_part_of_the_app() -> None:
    def row(pid: int, role: str, pct: float) -> dict:
        return {"pid": pid, "role": role, "cpu_pct_of_core": pct, "wakeups_per_s": 1.0, "threads": 1,
                "busiest_threads": []}

    rows = [row(1, "Serve replica decode", 2.5), row(2, "actor SchedulerService", 1.5), row(3, "Ray GCS", 1.0),
            row(4, "actor BareActor", 1.0)]
    f = idle.summarize(rows, 20.0, bare_pid=4)
    assert [r["pid"] for r in f["processes"]] == [1, 2, 3] and f["total_cpu_pct_of_core"] == 5.0
    assert (f["bare_actor_pct_of_core"], f["num_ray_workers"], f["floor_pct_of_core"]) == (1.0, 2, 2.0)
    assert [r.get("above_floor") for r in f["processes"]] == [1.5, 0.5, None]
    assert "Ray's floor" in idle.render(f)
