"""`ferry status` against the in-process app (engine-shaped and cluster-shaped `/health`), an
unhealthy server, and nothing at all; each worker's KV plan (how its pool was sized) on a line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.ops.conftest import App, ferry

CLUSTER_HEALTH = {
    "healthy": True,
    "workers": {
        "prefill-0": {"kind": "prefill", "healthy": True, "running": 2, "waiting": 5, "free_blocks": 100,
                      "total_blocks": 400},
        "decode-0": {"kind": "decode", "healthy": True, "running": 7, "waiting": 0, "free_blocks": 300,
                     "total_blocks": 400, "rss_mib": 1391, "kv_plan": None},
    },
}
GPU_PLAN = {  # the shape of `KVPlan.to_dict()`: a pool planned on half of a GPU, capped by its rows
    "source": "planned", "device": "cuda:0", "num_blocks": 18432, "block_size": 16, "bytes_per_block": 368640,
    "kv_bytes": 18432 * 368640, "weights_bytes": 270 << 20, "free_bytes": 75 << 30,
    "activation_peak_bytes": 3 << 29, "activation_measured": True, "fraction": 0.9, "share": 0.5,
    "capped_by": "max_rows_context", "max_tokens": 18432 * 16,
}


def test_table_for_the_engine_backend(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    assert ferry(["status", "--url", app.base_url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"ferry at {app.base_url}: healthy, model tiny, 1 worker(s)"
    assert out[1].split() == ["WORKER", "KIND", "HEALTH", "RUNNING", "WAITING", "KV", "USED", "KV", "FREE", "KV",
                              "TOTAL", "KV", "USE", "MEM", "MIB"]
    row = out[2].split()
    assert row[:-1] == ["engine", "colocated", "ok", "0", "0", "0", "128", "128", "0%"]
    assert int(row[-1]) > 50  # the server's own process: the engine runs in it
    assert out[3].split() == ["KV", "POOL", "DEVICE", "BLOCKS", "GIB", "TOKENS", "SIZED", "BY"]
    assert out[4].split() == ["engine", "cpu", "128", "0.00", "2,048", "explicit", "num_blocks"]  # the fixture's
    assert out[5] == "SLO attainment: n/a (this server does not report it)"


SLO_REPORT = {"window_s": 60.0, "tenants": {  # the shape of deploy/dashboard's `slo_report()`
    "online": {"ttft_slo_ms": 2000.0, "tpot_slo_ms": 100.0, "completed": 1000, "running": 3, "attainment": 0.987,
               "ttft_p99_ms": 1240.5, "tpot_p99_ms": 88.2},
    "idle": {"ttft_slo_ms": 500.0, "tpot_slo_ms": 40.0, "completed": 0, "running": 0, "attainment": None,
             "ttft_p99_ms": None, "tpot_p99_ms": None},
    "nightly": {"ttft_slo_ms": None, "tpot_slo_ms": None, "completed": 7, "running": 0, "attainment": None,
                "ttft_p99_ms": 30000.0, "tpot_p99_ms": 410.0},
}}


def test_table_and_json_for_cluster_workers_with_slo(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    app.backend.health_override = CLUSTER_HEALTH | {"slo": SLO_REPORT}
    assert ferry(["status", "--url", app.base_url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": healthy, 2 worker(s)")
    assert out[2].split() == ["decode-0", "decode", "ok", "7", "0", "100", "300", "400", "25%", "1391"]
    assert out[3].split() == ["prefill-0", "prefill", "ok", "2", "5", "300", "100", "400", "75%", "-"]  # unknown
    assert out[4] == "SLO attainment over the last 60 s:"  # no worker reported a KV plan: no KV table
    assert out[5].split() == ["TENANT", "TTFT", "SLO", "TPOT", "SLO", "DONE", "RUNNING", "MET", "P99", "TTFT",
                              "P99", "TPOT"]
    assert [line.split() for line in out[6:]] == [  # by name
        ["idle", "500", "ms", "40", "ms", "0", "0", "n/a", "-", "-"],
        ["nightly", "-", "-", "7", "0", "no", "SLO", "30,000", "ms", "410", "ms"],
        ["online", "2,000", "ms", "100", "ms", "1000", "3", "98.7%", "1,240", "ms", "88", "ms"],
    ]
    assert len({len(line) for line in out[5:]}) == 1  # aligned columns
    assert ferry(["status", "--url", app.base_url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["healthy"] is True and doc["status_code"] == 200 and doc["slo"] == SLO_REPORT
    assert doc["workers"][0] == {"name": "decode-0", "kind": "decode", "healthy": True, "running": 7,
                                 "waiting": 0, "free_blocks": 300, "total_blocks": 400, "rss_mib": 1391,
                                 "kv_plan": None, "used_blocks": 100}


def test_a_line_per_worker_says_how_its_kv_pool_was_sized(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    workers = CLUSTER_HEALTH["workers"]
    explicit = {"source": "kv_cache_bytes", "device": "cpu", "num_blocks": 512, "kv_bytes": 512 << 20,
                "max_tokens": 8192}
    app.backend.health_override = {"healthy": True, "workers": {
        "decode-0": dict(workers["decode-0"], kv_plan=GPU_PLAN),  # type: ignore[arg-type]
        "prefill-0": dict(workers["prefill-0"], kv_plan=explicit),  # type: ignore[arg-type]
        "prefill-1": {"kind": "prefill", "healthy": False}}}  # down: no load, no plan
    assert ferry(["status", "--url", app.base_url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[5].split() == ["KV", "POOL", "DEVICE", "BLOCKS", "GIB", "TOKENS", "SIZED", "BY"]
    assert out[6].split() == ["decode-0", "cuda:0", "18,432", "6.33", "294,912", "planned:", "0.9", "x", "0.5", "of",
                              "(75.00", "GiB", "free", "-", "1.50", "GiB", "step", "peak),", "capped", "by",
                              "max_rows_context"]
    assert out[7].split() == ["prefill-0", "cpu", "512", "0.50", "8,192", "explicit", "kv_cache_bytes"]
    assert out[8].split() == ["prefill-1", "-", "-", "-", "-", "-"]
    assert out[6].index("18,432") + 6 == out[7].index("512") + 3  # numbers right-aligned
    assert ferry(["status", "--url", app.base_url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [w["kv_plan"] for w in doc["workers"]] == [GPU_PLAN, explicit, None]


def test_a_window_without_tenants_says_so(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    app.backend.health_override = CLUSTER_HEALTH | {"slo": {"window_s": 12.4, "tenants": {}}}
    assert ferry(["status", "--url", app.base_url]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "SLO attainment over the last 12 s: no requests and no tenant with an SLO yet")


def test_json_has_null_slo_when_absent(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    assert ferry(["status", "--url", app.base_url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["slo"] is None and [w["name"] for w in doc["workers"]] == ["engine"]
    assert doc["workers"][0]["total_blocks"] == 128


def test_unhealthy_server_exits_1(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    down = dict(CLUSTER_HEALTH["workers"]["decode-0"], healthy=False)  # type: ignore[arg-type]
    app.backend.health_override = {"healthy": False, "workers": {"decode-0": down}}
    assert ferry(["status", "--url", app.base_url]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": UNHEALTHY, 1 worker(s)") and out[2].split()[2] == "DOWN"


def test_degraded_and_draining_servers_say_so(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    down = dict(CLUSTER_HEALTH["workers"]["decode-0"], healthy=False)  # type: ignore[arg-type]
    app.backend.health_override = {"healthy": True, "workers": {**CLUSTER_HEALTH["workers"], "decode-1": down},
                                   "degraded": {"down": ["decode-1"], "replacing": ["decode-1"]}}
    assert ferry(["status", "--url", app.base_url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": healthy, degraded: decode-1 down, replacing decode-1, 3 worker(s)")
    app.backend.health_override = {"healthy": False, "draining": True, "in_flight": 2}
    assert ferry(["status", "--url", app.base_url]) == 1
    assert capsys.readouterr().out.splitlines()[0].endswith(": UNHEALTHY (draining: 2 request(s) in flight), 0 worker(s)")


def test_a_reader_that_leaves_early_is_not_an_error(app: App) -> None:
    ferry_bin = Path(sys.executable).with_name("ferry")
    proc = subprocess.Popen([str(ferry_bin), "status", "--url", app.base_url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # like `| head -0`: gone before the table is written
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_nothing_listening_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert ferry(["status", "--url", url]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"ferry: error: cannot reach ferry at {url}: ")
    assert "is `ferry serve` running?" in captured.err


def test_status_codecs_prints_the_table(app: App, capsys: pytest.CaptureFixture[str]) -> None:
    app.backend.health_override = CLUSTER_HEALTH | {"slo": SLO_REPORT}
    assert ferry(["status", "--url", app.base_url, "--codecs"]) == 0
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("KV codecs (exact tenants"))
    assert out[at + 1].split()[:3] == ["DTYPE", "CODEC", "GREEDY"] and any(l.split()[:2] == ["float32", "int8"] for l in out[at:])
    assert ferry(["status", "--url", app.base_url, "--json", "--codecs"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_codecs"]["codecs"]["float32"]["none"]["forced_agreement"] == 1.0


def test_status_shows_what_each_lossy_codec_costs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The shipped quality file is what `ferry status` prints under the workers: every codec row, its
    agreement and drift; a missing or broken file prints nothing rather than failing the command."""
    import json

    from deploy.ops import QUALITY_FILE, codec_quality_lines

    doc = json.loads(QUALITY_FILE.read_text())
    lines = codec_quality_lines()
    assert lines[0].startswith("KV codecs (exact tenants: none, zstd") and doc["command"] in lines[0]
    for dtype, codecs in doc["codecs"].items():
        assert {"none", "int8", "fp8"} <= set(codecs)
        for name, q in codecs.items():
            row = next(line for line in lines if line.split()[:2] == [dtype, name])
            assert f"{q['forced_agreement']:.2%}" in row and f"{q['mean_kl']:.1e}" in row
    assert doc["codecs"]["float32"]["none"]["forced_agreement"] == 1.0  # exact KV agrees with itself
    assert doc["codecs"]["float32"]["int8"]["forced_agreement"] < 1.0  # the price is real, not a placeholder
    assert codec_quality_lines(tmp_path / "missing.json") == []
    (tmp_path / "bad.json").write_text("{")
    assert codec_quality_lines(tmp_path / "bad.json") == []
