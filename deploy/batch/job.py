"""Submitting the batch runner as a Ray job and following it to the end.

Mental model: the job is just `python -m deploy.batch.runner --in IN --out OUT ...` started by Ray's
job supervisor on the head node; it needs no `working_dir` because ferry is installed in the
cluster's Python. The client never talks to the runner: it polls the job's status through the job
submission API (the dashboard's HTTP port) and counts whole lines in OUT for the bar. So IN and OUT
are absolute paths that both this machine and the head node can see (the local cluster, or a
shared filesystem). Ctrl-C stops the job; what it finished stays in OUT and a resubmit does the rest.

Ray's token auth: `JobSubmissionClient` sends `~/.ray/auth_token` when `RAY_AUTH_MODE=token` (or the
token file exists); the local cluster of `ferry serve` runs with auth off, a `ray up` cluster with it on.
"""

from __future__ import annotations

import shlex
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from deploy.batch.progress import OutputWatcher, ProgressBar
from deploy.batch.runner import API_KEY_ENV, RunnerConfig

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
LOG_TAIL_LINES = 20
AGENT_WAIT_S = 60.0


@dataclass(frozen=True)
class JobSpec:
    in_path: Path  # absolute, as the head node sees it
    out_path: Path
    runner: RunnerConfig
    python: str  # the interpreter on the head node that has ferry installed


@dataclass(frozen=True)
class JobOutcome:
    job_id: str
    status: str  # SUCCEEDED, FAILED or STOPPED
    log_tail: str  # the job's last log lines: the runner's summary, or why it failed


def default_python(address: str) -> str:
    """The head node's interpreter. A job's entrypoint runs in a shell with the cluster's PATH, where
    a bare `python` may not be the (unactivated) venv Ray runs from; on this machine the cluster of
    `ferry serve` runs from the same environment as this command, so use its interpreter. On a remote
    head node, ferry is installed into the default `python` (deploy/cluster.yaml)."""
    host = urlparse(address).hostname or ""
    return sys.executable if host in LOOPBACK_HOSTS else "python"


def entrypoint(spec: JobSpec) -> str:
    r = spec.runner
    return shlex.join([spec.python, "-m", "deploy.batch.runner", "--in", str(spec.in_path), "--out",
                       str(spec.out_path), "--url", r.url, "--concurrency", str(r.concurrency),
                       "--max-retries", str(r.max_retries), "--timeout", f"{r.request_timeout_s:g}"])


def runtime_env(spec: JobSpec) -> dict[str, Any]:
    # The key travels as an env var, not an argument: entrypoints show in `ray job list` and `ps`.
    return {"env_vars": {API_KEY_ENV: spec.runner.api_key}} if spec.runner.api_key else {}


def submit(client: "JobSubmissionClient", spec: JobSpec, agent_wait_s: float = AGENT_WAIT_S) -> str:
    """Submits the runner and returns the job id. Right after a cluster starts, the dashboard
    answers before its node agent does and refuses jobs ("No available agent"): that is retried
    for up to `agent_wait_s`; every other refusal is raised."""
    submission_id = f"ferry-batch-{uuid.uuid4().hex[:12]}"
    deadline = time.monotonic() + agent_wait_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint(spec), runtime_env=runtime_env(spec),
                                     submission_id=submission_id,
                                     metadata={"ferry": "batch", "input": str(spec.in_path),
                                               "output": str(spec.out_path)})
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def follow(client: "JobSubmissionClient", job_id: str, watcher: OutputWatcher, bar: ProgressBar,
           poll_s: float = 0.5) -> JobOutcome:
    """Polls the job until it ends, drawing the bar from OUT; Ctrl-C stops the job and re-raises."""
    try:
        while True:
            status = client.get_job_status(job_id)
            bar.update(bar.done_before + watcher.poll())
            if status.is_terminal():
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        client.stop_job(job_id)  # the runner dies; its finished lines are already flushed
        raise
    bar.finish()
    logs = client.get_job_logs(job_id)  # the runner's summary, or why it failed
    return JobOutcome(job_id, status.value, "\n".join(logs.rstrip("\n").splitlines()[-LOG_TAIL_LINES:]))


def connect(address: str) -> "JobSubmissionClient":
    """A client of the job submission API at `address` (the dashboard's URL); raises ConnectionError
    when nothing answers there."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)
