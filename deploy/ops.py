"""`ferry status` and `ferry batch submit`: the operator's commands, as functions of parsed args.

Mental model: both are clients of a running ferry. `status` reads `/health` (public, one GET) and
turns it into a table of workers with their load and KV blocks, one line per worker on how its KV
pool was sized (device, blocks, GiB, tokens, explicit or planned), plus each tenant's SLO attainment
over the ingress's dashboard window (reported under `slo`; "n/a" from a server that does not). Exit codes are for scripts: 0 healthy, 1 answering but
unhealthy, 2 unreachable. `batch submit` validates the input here, before anything runs, then
either submits deploy/batch's runner as a Ray job (the default, through the dashboard's job API) or
runs it in-process (`--local`); both draw the same progress bar and both resume from OUT.

deploy/cli.py wires these in with `add_ops_parsers(sub)`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deploy.batch.format import load_done, read_input
from deploy.batch.job import JobSpec, connect, default_python, follow, submit
from deploy.batch.progress import OutputWatcher, ProgressBar
from deploy.batch.runner import API_KEY_ENV, RunnerConfig, run_batch

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_RAY_ADDRESS = "http://127.0.0.1:8265"
HEALTH_TIMEOUT_S = 10.0


class Unreachable(Exception):
    """Nothing (or nothing speaking ferry's JSON) answers at the URL."""


@dataclass(frozen=True)
class WorkerStatus:
    """One worker's row of `ferry status`, as `/health` reports it (None: not reported)."""

    name: str
    kind: str
    healthy: bool | None
    running: int | None
    waiting: int | None
    free_blocks: int | None
    total_blocks: int | None
    rss_mib: int | None = None
    kv_plan: dict[str, Any] | None = None  # `KVPlan.to_dict()` of the worker's engine, as /health reports it

    @property
    def used_blocks(self) -> int | None:
        if self.free_blocks is None or self.total_blocks is None:
            return None
        return self.total_blocks - self.free_blocks


def fetch_health(url: str, api_key: str | None, timeout_s: float = HEALTH_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON body) of `/health`. A 503 is an answer too: an unhealthy server still says why."""
    req = urllib.request.Request(url.rstrip("/") + "/health", headers={"Accept": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:  # refused, no route, DNS, timeout
        raise Unreachable(str(getattr(e, "reason", e))) from e
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Unreachable(f"HTTP {status} with a non-JSON body: is this a ferry server?") from None
    if not isinstance(body, dict) or "healthy" not in body:
        raise Unreachable(f"HTTP {status} without a 'healthy' field: is this a ferry server?")
    return status, body


def workers_of(health: dict[str, Any]) -> list[WorkerStatus]:
    """Per-worker loads: the cluster backend reports `workers`; the in-process engine backend
    reports one engine's counters at the top level."""
    if isinstance(health.get("workers"), dict):
        return [WorkerStatus(name, str(w.get("kind", "?")), w.get("healthy"), w.get("running"), w.get("waiting"),
                             w.get("free_blocks"), w.get("total_blocks"), w.get("rss_mib"), _plan(w.get("kv_plan")))
                for name, w in sorted(health["workers"].items())]
    if "num_running" in health:
        return [WorkerStatus("engine", "colocated", health.get("healthy"), health.get("num_running"),
                             health.get("num_waiting"), health.get("num_blocks_free"), health.get("num_blocks_total"),
                             health.get("rss_mib"), _plan(health.get("kv_plan")))]
    return []


def _plan(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def _ms(value: Any) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:,.0f} ms"


def _table(rows: list[tuple[str, ...]], num_left: int) -> list[str]:
    """Rows of cells in aligned columns: the first `num_left` left-aligned (names), the rest right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(widths[i]) if i < num_left else c.rjust(widths[i]) for i, c in enumerate(r))
            for r in rows]


def kv_plan_lines(workers: list[WorkerStatus]) -> list[str]:
    """How each worker's KV pool was sized (the `kv_plan` of `/health`): device, blocks, GiB, the
    tokens it holds, and why that size: an explicit setting, or planned from the memory left after
    the weights and a profiled step (fraction x share of what was free), and what capped it. Nothing
    from a server that does not report plans; "-" for a worker that did not (down, being replaced)."""
    if not any(w.kv_plan for w in workers):
        return []
    rows, why = [("KV POOL", "DEVICE", "BLOCKS", "GIB", "TOKENS")], ["SIZED BY"]
    for w in workers:
        p = w.kv_plan or {}
        gib = f"{p['kv_bytes'] / (1 << 30):.2f}" if isinstance(p.get("kv_bytes"), int) else "-"
        rows.append((w.name, _cell(p.get("device")), _count(p.get("num_blocks")), gib, _count(p.get("max_tokens"))))
        why.append(_sized_by(p) if p else "-")
    return [f"{line}  {reason}" for line, reason in zip(_table(rows, num_left=2), why)]


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def _sized_by(plan: dict[str, Any]) -> str:
    source = plan.get("source")
    if source != "planned":
        return f"explicit {source}"
    free, fraction, share = plan.get("free_bytes"), plan.get("fraction"), plan.get("share")
    out = "planned"
    if isinstance(free, int) and isinstance(fraction, int | float) and isinstance(share, int | float):
        peak = plan.get("activation_peak_bytes")
        less = f" - {peak / (1 << 30):.2f} GiB step peak" if isinstance(peak, int) else ""
        out += f": {fraction:.3g} x {share:.3g} of ({free / (1 << 30):.2f} GiB free{less})"
    if plan.get("activation_measured") is False:
        out += " (step peak estimated)"
    return out + (f", capped by {plan['capped_by']}" if plan.get("capped_by") else "")


def slo_lines(slo: Any) -> list[str]:
    """The `slo` of `/health` (deploy/dashboard's `slo_report`) as a table of tenants: their P99
    targets, requests completed in the window, the fraction that met both targets, measured P99s."""
    if not isinstance(slo, dict) or not isinstance(slo.get("tenants"), dict):
        return ["SLO attainment: n/a (this server does not report it)"]
    tenants = slo["tenants"]
    head = f"SLO attainment over the last {slo.get('window_s', 0):.0f} s"
    if not tenants:
        return [f"{head}: no requests and no tenant with an SLO yet"]
    rows = [("TENANT", "TTFT SLO", "TPOT SLO", "DONE", "RUNNING", "MET", "P99 TTFT", "P99 TPOT")]
    for name, t in sorted(tenants.items()):
        has_slo = t.get("ttft_slo_ms") is not None
        met = t.get("attainment")
        met_cell = "no SLO" if not has_slo else ("n/a" if met is None else f"{met:.1%}")
        rows.append((name, _ms(t.get("ttft_slo_ms")), _ms(t.get("tpot_slo_ms")), _cell(t.get("completed")),
                     _cell(t.get("running")), met_cell, _ms(t.get("ttft_p99_ms")), _ms(t.get("tpot_p99_ms"))))
    return [f"{head}:"] + _table(rows, num_left=1)


def render_status(url: str, health: dict[str, Any]) -> str:
    workers = workers_of(health)
    state = "healthy" if health.get("healthy") else "UNHEALTHY"
    why = f" ({health['error']})" if health.get("error") else ""
    degraded = health.get("degraded")
    if isinstance(degraded, dict) and degraded.get("down"):
        replacing = degraded.get("replacing") or []
        why += f", degraded: {', '.join(degraded['down'])} down" + (
            f", replacing {', '.join(replacing)}" if replacing else "")
    if health.get("draining"):
        why += f" (draining: {health.get('in_flight', 0)} request(s) in flight)"
    model = f", model {health['model']}" if health.get("model") else ""
    out = [f"ferry at {url}: {state}{why}{model}, {len(workers)} worker(s)"]
    rows = [("WORKER", "KIND", "HEALTH", "RUNNING", "WAITING", "KV USED", "KV FREE", "KV TOTAL", "KV USE", "MEM MIB")]
    for w in workers:
        use = f"{w.used_blocks / w.total_blocks:.0%}" if w.used_blocks is not None and w.total_blocks else "-"
        health_cell = "-" if w.healthy is None else ("ok" if w.healthy else "DOWN")
        rows.append((w.name, w.kind, health_cell, _cell(w.running), _cell(w.waiting), _cell(w.used_blocks),
                     _cell(w.free_blocks), _cell(w.total_blocks), use, _cell(w.rss_mib)))
    if len(rows) > 1:
        out += _table(rows, num_left=3)
    return "\n".join(out + kv_plan_lines(workers) + slo_lines(health.get("slo")))


QUALITY_FILE = Path(__file__).with_name("kv_codec_quality.json")


def codec_quality_lines(path: Path = QUALITY_FILE) -> list[str]:
    """What each KV codec costs in output quality on SmolLM2, as `bench/transfer.py --write-quality`
    measured it: the price a tenant with kv_fidelity lossy pays (exact tenants get none or zstd)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    out = [f"KV codecs (exact tenants: none, zstd, bit-exact; lossy tenants may get int8, fp8). Measured "
           f"{doc.get('measured', '?')} on {doc.get('model', '?')}, {doc.get('prompts')} prompts x {doc.get('tokens')} "
           f"greedy tokens ({doc.get('command', '')}):"]
    rows = [("DTYPE", "CODEC", "GREEDY AGREEMENT", "IDENTICAL PROMPTS", "MEAN KL (NATS)", "MAX LOGIT DIFF")]
    for dtype, codecs in doc.get("codecs", {}).items():
        for name, q in codecs.items():
            rows.append((dtype, name, f"{q['forced_agreement']:.2%}", f"{q['prompts_identical']}/{doc.get('prompts')}",
                         f"{q['mean_kl']:.1e}", f"{q['max_logit_diff']:.3f}"))
    return out + _table(rows, num_left=2)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        status, health = fetch_health(args.url, args.api_key or os.environ.get(API_KEY_ENV))
    except Unreachable as e:
        print(f"ferry: error: cannot reach ferry at {args.url}: {e}\n"
              f"  is `ferry serve` running? (or pass --url)", file=sys.stderr)
        return 2
    if args.json:
        doc = {"url": args.url, "status_code": status, "healthy": bool(health.get("healthy")),
               "workers": [asdict(w) | {"used_blocks": w.used_blocks} for w in workers_of(health)],
               "slo": health.get("slo"), "health": health}
        if args.codecs:
            doc["kv_codecs"] = json.loads(QUALITY_FILE.read_text()) if QUALITY_FILE.is_file() else None
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join([render_status(args.url, health), *(codec_quality_lines() if args.codecs else [])]))
    return 0 if health.get("healthy") else 1


def cmd_batch_submit(args: argparse.Namespace) -> int:
    in_path, out_path = Path(args.input).resolve(), Path(args.out).resolve()
    if in_path == out_path:
        raise ValueError("--out must differ from the input file")
    lines = read_input(in_path)  # BatchInputError (a ValueError) names every bad line; nothing is sent
    done, whole = load_done(out_path, repair=False)  # the runner repairs under its lock; this only counts
    already = sum(1 for line in lines if line.custom_id in done)
    cfg = RunnerConfig(args.url, args.api_key or os.environ.get(API_KEY_ENV) or None, args.concurrency,
                       args.max_retries, args.timeout)
    print(f"{len(lines)} requests in {in_path}; {already} already in {out_path}", file=sys.stderr)
    if already == len(lines):
        print("nothing to do", file=sys.stderr)
        return 0
    bar = ProgressBar(len(lines), already)
    if args.local:
        report = asyncio.run(run_batch(in_path, out_path, cfg, lambda r: bar.update(r.done)))
        bar.finish()
        print(report.summary(), file=sys.stderr)
        return 1 if report.unfinished else 0
    spec = JobSpec(in_path, out_path, cfg, args.python or default_python(args.address))
    try:
        client = connect(args.address)
    except ConnectionError as e:
        print(f"ferry: error: no Ray job API at {args.address}: {e}\n"
              f"  start ferry with `ferry serve`, pass --address, or run in-process with --local", file=sys.stderr)
        return 2
    job_id = submit(client, spec)
    print(f"submitted Ray job {job_id} to {args.address} (`ray job logs {job_id}` shows its log)", file=sys.stderr)
    try:
        outcome = follow(client, job_id, OutputWatcher(out_path, whole), bar)
    except KeyboardInterrupt:
        print(f"\nstopped Ray job {job_id}; finished lines are in {out_path}: submit again to do the rest",
              file=sys.stderr)
        return 130
    summary = [ln for ln in outcome.log_tail.splitlines() if ln.startswith("ferry-batch: ")]
    if outcome.status != "SUCCEEDED":
        print(f"ferry: error: Ray job {job_id} {outcome.status}; its last log lines:\n{outcome.log_tail}",
              file=sys.stderr)
        return 1
    print(summary[-1] if summary else f"Ray job {job_id} succeeded", file=sys.stderr)
    return 0


def add_ops_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Adds `status` and `batch submit` to the `ferry` command's subparsers."""
    key_help = f"API key (default ${API_KEY_ENV})"
    st = sub.add_parser("status", help="workers, health, load and SLO attainment of a running ferry")
    st.add_argument("--url", default=DEFAULT_URL, help=f"ferry API (default {DEFAULT_URL})")
    st.add_argument("--api-key", default=None, help=key_help)
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--codecs", action="store_true",
                    help="also show what each KV codec costs in greedy agreement and logprob drift (measured by "
                         "bench/transfer.py --write-quality): the price of kv_fidelity: lossy")
    st.set_defaults(func=cmd_status)

    batch = sub.add_parser("batch", help="OpenAI-format batch jobs").add_subparsers(dest="batch_cmd", required=True)
    bs = batch.add_parser("submit", help="run a batch file as a Ray job on the `batch` SLO class; resumes from --out")
    bs.add_argument("input", metavar="IN.jsonl", help="one request a line: custom_id, method, url, body")
    bs.add_argument("--out", required=True, metavar="OUT.jsonl", help="results, appended; lines already there are skipped")
    bs.add_argument("--url", default=DEFAULT_URL, help=f"ferry API as the job sees it (default {DEFAULT_URL})")
    bs.add_argument("--api-key", default=None, help=key_help)
    bs.add_argument("--concurrency", type=int, default=RunnerConfig.concurrency, help="requests in flight")
    bs.add_argument("--max-retries", type=int, default=RunnerConfig.max_retries,
                    help="per line, for 429s (after Retry-After) and refused connections")
    bs.add_argument("--timeout", type=float, default=RunnerConfig.request_timeout_s, help="seconds per request")
    bs.add_argument("--address", default=DEFAULT_RAY_ADDRESS, help="Ray job submission API (the dashboard URL)")
    bs.add_argument("--python", default=None, help="interpreter on the head node with ferry installed "
                                                   "(default: this one for a local cluster, else `python`)")
    bs.add_argument("--local", action="store_true", help="run in this process, without Ray")
    bs.set_defaults(func=cmd_batch_submit)
