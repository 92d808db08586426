"""`ferry batch submit` through a real local Ray cluster's job submission API.

Mental model: the cluster is a `ray start --head --block` child process bound to loopback, on free
ports, with Ray auth off, so these tests neither depend on nor disturb the pytest process's Ray
state or other clusters on the machine; SIGTERM to that process stops exactly that cluster. Jobs
run the runner with this venv's interpreter and post to the in-process app, whose recorder shows
exactly which lines the server received: a resumed job must send precisely the lines OUT does not
hold yet.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from deploy.batch.format import load_done
from deploy.batch.job import JobSpec, connect, default_python, submit
from deploy.batch.runner import RunnerConfig
from tests.deploy.ops.conftest import App, batch_request, ferry, read_jsonl, write_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`ray start --head --block` on loopback with every fixed-by-default port (GCS, dashboard, its
    agent, Ray client, metrics) on a free one, since other clusters may share this machine, and a
    private temp dir, so the shared /tmp/ray never points at it. SIGTERM stops exactly its processes
    (`ray stop` would stop every Ray cluster of this user)."""
    dashboard_port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="fry", dir="/tmp")  # short: Ray's socket paths live under it
    env = os.environ | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    ports = {"--port": free_port(), "--dashboard-port": dashboard_port, "--dashboard-agent-listen-port": free_port(),
             "--ray-client-server-port": free_port(), "--metrics-export-port": free_port()}
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", "--num-cpus=1",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1",
           f"--temp-dir={temp_dir}", "--disable-usage-stats", *(f"{k}={v}" for k, v in ports.items())]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 90
        while True:  # the job API answers once the head is up; `submit` waits for its agent
            assert proc.poll() is None, f"ray start exited with {proc.returncode}"
            try:
                connect(address)
                break
            except ConnectionError:
                assert time.monotonic() < deadline, "the job submission API never answered"
                time.sleep(0.5)
        yield address, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # gRPC listens on "::ffff:127.0.0.1"
    return (mapped or addr).is_loopback


def ids_by_body(lines: list[dict[str, Any]]) -> dict[str, str]:
    return {json.dumps(line["body"], sort_keys=True): line["custom_id"] for line in lines}


def sent_ids(app: App, lines: list[dict[str, Any]]) -> list[str]:
    by_body = ids_by_body(lines)
    return sorted(by_body[json.dumps(s.body, sort_keys=True)] for s in app.recorder.seen)


def test_twenty_lines_complete_and_resume(app: App, ray_cluster: tuple[str, subprocess.Popen[bytes]],
                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    address, proc = ray_cluster
    lines = [batch_request(i) for i in range(20)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    argv = ["batch", "submit", str(inp), "--out", str(out), "--url", app.base_url, "--address", address]
    assert ferry(argv + ["--concurrency", "4"]) == 0
    rows = read_jsonl(out)
    assert len(rows) == 20 and sorted(r["custom_id"] for r in rows) == sorted(ln["custom_id"] for ln in lines)
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in rows)
    assert sent_ids(app, lines) == sorted(ln["custom_id"] for ln in lines)  # each line sent once
    assert {s.slo_class for s in app.recorder.seen} == {"batch"}
    err = capsys.readouterr().err
    assert "submitted Ray job ferry-batch-" in err and "20/20 100%" in err
    assert "ferry-batch: 20/20 lines done: 20 ok, 0 failed this run, 0 already in the output" in err

    # Every process of the cluster (GCS, raylet, dashboard, job supervisor) listens on loopback only.
    pids = {proc.pid} | {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
    listening = [c.laddr for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.pid in pids]
    assert listening and all(is_loopback(a.ip) for a in listening), listening

    # Resume: lines 0-9 finished (in the file's completion order they are scattered), then a torn line.
    first_ten = {f"req-{i}" for i in range(10)}
    kept = [json.dumps(r) + "\n" for r in rows if r["custom_id"] in first_ten]
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_text("".join(kept) + '{"id": "batch_req_torn", "custom_id": "req-1')
    app.recorder.seen.clear()
    assert ferry(["batch", "submit", str(inp), "--out", str(resumed), "--url", app.base_url,
                  "--address", address]) == 0
    assert sent_ids(app, lines) == sorted(f"req-{i}" for i in range(10, 20))  # nothing redone
    ids = [r["custom_id"] for r in read_jsonl(resumed)]
    assert len(ids) == 20 and len(set(ids)) == 20
    assert resumed.read_text().startswith("".join(kept))
    assert "10 already in" in capsys.readouterr().err


def test_job_stopped_midway_then_resubmitted(app: App, ray_cluster: tuple[str, subprocess.Popen[bytes]],
                                             tmp_path: Path) -> None:
    address, _ = ray_cluster
    app.backend.delay_s = 0.25  # ~20 x 0.25 s / 2 in flight: long enough to stop it halfway
    lines = [batch_request(i) for i in range(20)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    client = connect(address)
    spec = JobSpec(inp, out, RunnerConfig(app.base_url, concurrency=2), default_python(address))
    job_id = submit(client, spec)
    deadline = time.monotonic() + 60
    while not out.exists() or len(load_done(out, repair=False)[0]) < 5:
        assert time.monotonic() < deadline and not client.get_job_status(job_id).is_terminal()
        time.sleep(0.1)
    client.stop_job(job_id)
    while not client.get_job_status(job_id).is_terminal():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert client.get_job_status(job_id).value == "STOPPED"
    done_at_stop, _ = load_done(out, repair=False)
    assert 5 <= len(done_at_stop) < 20
    app.recorder.seen.clear()
    app.backend.delay_s = 0.0
    assert ferry(["batch", "submit", str(inp), "--out", str(out), "--url", app.base_url, "--address", address]) == 0
    # The resubmit sent exactly the lines the stopped job had not written, each once.
    assert sent_ids(app, lines) == sorted({ln["custom_id"] for ln in lines} - done_at_stop)
    ids = [r["custom_id"] for r in read_jsonl(out)]
    assert len(ids) == 20 and len(set(ids)) == 20


def test_failed_job_exits_nonzero(ray_cluster: tuple[str, subprocess.Popen[bytes]], tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    address, _ = ray_cluster
    inp, out = write_jsonl(tmp_path / "in.jsonl", [batch_request(0)]), tmp_path / "out.jsonl"
    dead = f"http://127.0.0.1:{free_port()}"
    assert ferry(["batch", "submit", str(inp), "--out", str(out), "--url", dead, "--address", address,
                  "--max-retries", "0"]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "1 unfinished (server unreachable" in err
    assert out.read_text() == ""


def test_no_job_api_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp, out = write_jsonl(tmp_path / "in.jsonl", [batch_request(0)]), tmp_path / "out.jsonl"
    address = f"http://127.0.0.1:{free_port()}"
    assert ferry(["batch", "submit", str(inp), "--out", str(out), "--address", address]) == 2
    assert f"no Ray job API at {address}" in capsys.readouterr().err
