"""Many nodes, launched by Ray's autoscaler on this machine: a burst that adds a decode node, the
loss of that node under load, and the way back down.

Mental model: `ray start --head --autoscaling-config=deploy/cluster-local.yaml` with Ray's fake
multi-node provider (RAY_FAKE_CLUSTER=1; the YAML says why not `ray up`) starts the head, and its
autoscaler starts the always-on `cpu_mixed` node (prefill, decode, cache roles). The app of
deploy/serve.yaml runs on them, placed by role (`placement:`), with the scheduler's decode scaling
on (at most 2 replicas). A burst of streams (`--streams`, one every `--interval` s, prompts of
`--prompt-tokens`, greedy, `--max-tokens` each) fills the decode rows: the scheduler advises a
second decode replica, which can only go on a `cpu_decode` node (each node holds one decode
worker), so it waits while the autoscaler starts one. Once the new worker serves, a second wave
(`--second-wave`, at once) gives it rows; once it decodes some, its node is killed at once, every
process of it (`--no-node-loss` skips this): its streams resume elsewhere,
and the deployment's replacement replica asks the autoscaler for a node again. After the burst the
advice falls back to one replica and the idle node is stopped (`idle_timeout_minutes`). Then the
cluster is torn down (every process `ray start` started, by PID) and the engine alone computes the
greedy reference: a stream counts as identical when its text equals it.

Figures: the nodes seen (type, when up, when gone, how), requests sent / finished / refused (429 or
503, with Retry-After) / lost (an error, a broken stream, a hang past --request-timeout) /
identical, TTFT p50/p99 of the requests sent before the added node's worker served ("during
scale-up") and after, the most decode replicas, and the times of each step. Everything binds
127.0.0.1.

    python -m bench.multinode [--streams 16] [--second-wave 8] [--interval 1] [--prompt-tokens 512]
                              [--max-tokens 128] [--rows 4] [--no-node-loss] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench.common import Figures, bench_parser, format_table, free_port, progress, run, stdout_to_stderr, wait_healthy
from bench.fake_cluster import APP, Watch, connect, kill_node, kill_tree, start_head
from bench.sim.metrics import percentile

REPO = Path(__file__).resolve().parents[1]
CLUSTER_CONFIG = REPO / "deploy" / "cluster-local.yaml"
SERVE_CONFIG = REPO / "deploy" / "serve.yaml"
PLACEMENT = {"head": "ferry_head", "prefill": "ferry_prefill", "decode": "ferry_decode", "cache": "ferry_cache"}


@dataclass
class Stream:
    index: int
    sent_s: float = 0.0  # since the burst began
    ttft_s: float | None = None
    status: int | None = None
    text: str = ""
    error: str | None = None
    done: bool = False  # the stream ended with [DONE]
    sent: bool = False

    @property
    def outcome(self) -> str:
        if not self.sent:
            return "not sent"
        if self.status in (429, 503):
            return "refused"
        return "finished" if self.done and self.error is None and self.status == 200 else "lost"


def prompts_of(model: str, num_tokens: int, count: int) -> list[str]:
    """`count` distinct texts of about `num_tokens` tokens: windows of the README."""
    from actors.engine.fetch import resolve_model
    from actors.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model(model))
    ids = tok.encode((REPO / "README.md").read_text())
    step = max(1, (len(ids) - num_tokens) // max(1, count))
    return [tok.decode(ids[i * step : i * step + num_tokens]) for i in range(count)]


def stream_one(url: str, model: str, prompt: str, s: Stream, max_tokens: int, t0: float, timeout_s: float) -> None:
    import httpx2

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    s.sent_s = time.monotonic() - t0
    try:
        with httpx2.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s, trust_env=False) as r:
            s.status = r.status_code
            if r.status_code != 200:
                s.error = r.read().decode(errors="replace")[:200]
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    s.done = True
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    s.error = str(event["error"])[:200]
                    return
                if s.ttft_s is None:
                    s.ttft_s = time.monotonic() - t0 - s.sent_s
                s.text += event["choices"][0].get("text", "")
    except Exception as e:  # noqa: BLE001 - any failure of a stream is a lost request, reported
        s.error = f"{type(e).__name__}: {e}"[:200]


def app_config(args: argparse.Namespace) -> dict[str, Any]:
    from deploy.config import read_args

    raw = read_args(str(SERVE_CONFIG))
    raw["model"] = args.model
    raw["placement"] = {**PLACEMENT, "worker_share": 1}  # one worker of a role per unit a node declares
    raw.setdefault("engine", {})["max_num_seqs"] = args.rows
    raw.setdefault("scheduler", {})["scaling"] = {"max_decode": 2, "up_delay_s": 1.0, "down_delay_s": 5.0}
    return raw


def bench(args: argparse.Namespace) -> Figures:
    with stdout_to_stderr():
        return _bench(args)


def _bench(args: argparse.Namespace) -> Figures:
    from deploy.local import idle_env, loopback_env

    loopback_env()  # before ray is imported: every node this cluster starts inherits it
    idle_env()
    raw = app_config(args)
    prompts = prompts_of(args.model, args.prompt_tokens, args.streams + args.second_wave)
    work = Path(tempfile.mkdtemp(prefix="ferry-multinode-"))
    gcs_port = args.gcs_port or free_port()
    cluster_cfg = yaml.safe_load(CLUSTER_CONFIG.read_text())
    cluster_cfg["provider"]["gcs_address"] = f"127.0.0.1:{gcs_port}"
    config = work / "cluster-local.yaml"
    config.write_text(yaml.safe_dump(cluster_cfg))
    t0 = time.monotonic()
    progress(f"starting the head (GCS 127.0.0.1:{gcs_port}; its log {work / 'ray-start.log'}) ...")
    head = start_head(config, gcs_port, free_port(), work / "ray-start.log")
    watch = Watch(t0)
    streams = [Stream(i) for i in range(args.streams + args.second_wave)]
    marks: dict[str, float] = {}
    peak_rows: dict[str, int] = {}
    unhealthy: list[str] = []
    stop = threading.Event()
    import ray
    from ray import serve

    try:
        connect(ray, gcs_port, head)
        marks["head_up_s"] = time.monotonic() - t0

        def watching() -> None:
            while not stop.is_set():
                try:
                    watch.poll()
                except Exception as e:  # noqa: BLE001 - a poll during a node's death can fail; the next one runs
                    progress(f"poll failed: {e!r}")
                stop.wait(0.5)

        watcher = threading.Thread(target=watching, daemon=True)
        watcher.start()
        _until(lambda: watch.alive("cpu_mixed"), args.node_timeout, "the autoscaler never started cpu_mixed")
        marks["mixed_node_up_s"] = time.monotonic() - t0
        progress(f"cpu_mixed node up at {marks['mixed_node_up_s']:.0f} s; starting the app ({args.model}) ...")
        from deploy.apps import build_app

        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(raw), name=APP, route_prefix="/", blocking=False, external_scaler_enabled=True)
        url = f"http://127.0.0.1:{args.port}"
        wait_healthy(url, args.startup_timeout)
        marks["app_healthy_s"] = time.monotonic() - t0
        progress(f"healthy at {marks['app_healthy_s']:.0f} s; burst of {args.streams} streams ...")
        peak_rows, unhealthy = _burst(url, args, prompts, streams, watch, marks, head)
        progress("burst over; waiting for one decode replica and no cpu_decode node ...")
        try:
            _until(lambda: watch.decode_replicas() == 1 and not watch.alive("cpu_decode"), args.down_timeout,
                   "no scale-down")
            marks["scaled_down_s"] = time.monotonic() - t0
        except TimeoutError as e:
            progress(str(e))
    finally:
        stop.set()
        progress("tearing the cluster down ...")
        try:
            serve.shutdown()
        except Exception as e:  # noqa: BLE001 - the cluster goes anyway
            progress(f"serve.shutdown: {e!r}")
        ray.shutdown()
        killed = kill_tree(psutil.Process(head.pid))
        progress(f"ended {killed} processes of the cluster")
    figures = summarize(streams, watch, marks)
    figures["peak_rows_by_decode_worker"] = peak_rows
    figures["decode_workers_seen_unhealthy"] = unhealthy
    figures["identical"] = _identical(args, prompts, streams) if args.reference else None
    figures["setup"] = {"model": args.model, "streams": args.streams, "second_wave": args.second_wave,
                        "interval_s": args.interval,
                        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rows": args.rows,
                        "node_loss": args.node_loss, "cluster_config": str(CLUSTER_CONFIG.relative_to(REPO))}
    shutil.rmtree(work, ignore_errors=True)
    return figures


def _until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:g} s")
        time.sleep(0.5)


def _decode_workers(url: str) -> dict[str, dict[str, Any]]:
    """The decode workers `/health` lists, by name ({} when it does not answer)."""
    import httpx2

    try:
        report = httpx2.get(f"{url}/health", timeout=10, trust_env=False).json()
    except (httpx2.HTTPError, ValueError):
        return {}
    return {name: w for name, w in report.get("workers", {}).items() if w.get("kind") == "decode"}


def _burst(url: str, args: argparse.Namespace, prompts: list[str], streams: list[Stream], watch: Watch,
           marks: dict[str, float], head: subprocess.Popen[bytes]) -> tuple[dict[str, int], list[str]]:
    """The first `args.streams` streams, one every `args.interval` s; once the added node's decode
    worker serves, the second wave (`args.second_wave`, at once), so that it takes rows; once it
    decodes some, its node is killed (with `args.node_loss`). Returns when every stream has ended,
    with the most rows each decode worker was seen decoding and those it ever listed unhealthy
    (excluded from placement), from `/health`, polled."""
    import httpx2

    t0 = watch.t0
    burst_t0 = time.monotonic()
    model = httpx2.get(f"{url}/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
    first = set(_decode_workers(url))  # the mixed node's decode worker
    peak_rows: dict[str, int] = {}
    unhealthy_seen: set[str] = set()
    waves = (streams[:args.streams], streams[args.streams:])
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = []

        def send(wave: list[Stream], interval_s: float) -> None:
            for s in wave:
                s.sent = True
                futures.append(pool.submit(stream_one, url, model, prompts[s.index], s, args.max_tokens, t0,
                                           args.request_timeout))
                time.sleep(interval_s)

        send(waves[0], args.interval)
        second_sent = not waves[1]
        # The second wave goes when the added worker serves; if the first wave ends before that, it
        # waits for it, at most `args.added_wait` s from the burst's start (then it is sent anyway).
        while not (all(f.done() for f in futures) and second_sent):
            added = watch.alive("cpu_decode")
            if added and "added_node_up_s" not in marks:
                marks["added_node_up_s"] = time.monotonic() - t0
                progress(f"the autoscaler added a cpu_decode node at {marks['added_node_up_s']:.0f} s")
            decoders = _decode_workers(url)
            for name, w in decoders.items():  # the most rows each decode worker was seen decoding
                label = "mixed node" if name in first else f"added {name}"
                peak_rows[label] = max(peak_rows.get(label, 0), w.get("running", 0))
                if not w.get("healthy", True):  # seen excluded from placement at least once
                    unhealthy_seen.add(label)
            new = {n: w for n, w in decoders.items() if n not in first} if added else {}
            if new and "added_worker_serving_s" not in marks:
                marks["added_worker_serving_s"] = time.monotonic() - t0
                progress(f"its decode worker serves at {marks['added_worker_serving_s']:.0f} s")
            waited_out = time.monotonic() - burst_t0 > args.added_wait
            if not second_sent and ("added_worker_serving_s" in marks or waited_out):
                second_sent = True
                marks["second_wave_s"] = time.monotonic() - t0
                progress(f"second wave of {len(waves[1])} streams"
                         + ("" if "added_worker_serving_s" in marks else " (no added worker serves yet)"))
                send(waves[1], 0.1)
            # Streams placed there: rows it reported decoding, plus the router's own requests on it
            # ("waiting" counts those in), which /health shows even when the loaded worker's load
            # call timed out (then "running" reads 0).
            rows = sum(w.get("running", 0) + w.get("waiting", 0) for w in new.values())
            if rows and args.node_loss and "node_killed_s" not in marks:
                watch.killed.add(added[0])
                marks["node_killed_s"] = time.monotonic() - t0
                marks["streams_on_killed_node"] = rows
                n = kill_node(psutil.Process(head.pid), added[0])
                progress(f"killed the added node ({n} processes) with {rows} streams placed on it and "
                         f"{sum(not f.done() for f in futures)} streams running")
            time.sleep(0.5)
    marks["burst_s"] = time.monotonic() - burst_t0
    if unhealthy_seen:
        progress(f"decode workers /health showed unhealthy at least once: {', '.join(sorted(unhealthy_seen))}")
    return peak_rows, sorted(unhealthy_seen)


def _identical(args: argparse.Namespace, prompts: list[str], streams: list[Stream]) -> int:
    """How many finished streams equal the engine alone, greedy (computed after the cluster is gone)."""
    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine
    from actors.engine.sampling import SamplingParams

    progress("the engine alone's greedy reference ...")
    engine = Engine.from_pretrained(args.model, EngineConfig(kv_cache_bytes=256 << 20))
    want = engine.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
    return sum(s.outcome == "finished" and s.text == w.text for s, w in zip(streams, want))


def _pct(values: list[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(p, 1)


def summarize(streams: list[Stream], watch: Watch, marks: dict[str, float]) -> Figures:
    serving = marks.get("added_worker_serving_s", float("inf"))  # sent before it: during the scale-up
    during = [s.ttft_s for s in streams if s.ttft_s is not None and s.sent_s < serving]
    after = [s.ttft_s for s in streams if s.ttft_s is not None and s.sent_s >= serving]
    outcomes = [s.outcome for s in streams]
    return {
        "nodes": [{"node_id": nid[-8:], **e} for nid, e in watch.nodes.items()],
        "requests": {"sent": outcomes.count("finished") + outcomes.count("refused") + outcomes.count("lost"),
                     "finished": outcomes.count("finished"), "refused": outcomes.count("refused"),
                     "lost": outcomes.count("lost"), "not_sent": outcomes.count("not sent")},
        "errors": [f"stream {s.index}: {s.status} {s.error}" for s in streams if s.outcome in ("lost", "refused")][:10],
        "ttft_s": {"scale_up_p50": _pct(during, 50), "scale_up_p99": _pct(during, 99),
                   "after_p50": _pct(after, 50), "after_p99": _pct(after, 99)},
        "max_decode_replicas": max((n for _, n in watch.replicas), default=0),
        "streams_on_killed_node": marks.get("streams_on_killed_node"),  # streams placed on the lost node when it went
        "marks_s": {k: round(v, 1) for k, v in marks.items() if k.endswith("_s")},
    }


def render(f: Figures) -> str:
    r, t = f["requests"], f["ttft_s"]
    nodes = format_table(["node", "type", "up (s)", "gone (s)", "how"],
                         [(n["node_id"], n["type"], n["up_s"], n["gone_s"], n["how"] or "") for n in f["nodes"]],
                         title=f"nodes of {f['setup']['cluster_config']} (Ray's fake multi-node autoscaler)")
    reqs = format_table(
        ["sent", "finished", "refused", "lost", "not sent", "identical", "TTFT p50 / p99 scale-up (s)", "after (s)",
         "max decode replicas", "streams on the killed node"],
        [(r["sent"], r["finished"], r["refused"], r["lost"], r.get("not_sent", 0), f["identical"], f"{t['scale_up_p50']} / {t['scale_up_p99']}",
          f"{t['after_p50']} / {t['after_p99']}", f["max_decode_replicas"], f["streams_on_killed_node"])],
        title=f"burst: {f['setup']['streams']} streams of {f['setup']['prompt_tokens']} prompt tokens, "
              f"{f['setup']['max_tokens']} out, one every {f['setup']['interval_s']:g} s, then "
              f"{f['setup'].get('second_wave', 0)} at once when the added node serves")
    marks = format_table(["step", "at (s)"], list(f["marks_s"].items()), title="timeline")
    rows = format_table(["decode worker", "most rows seen"], list(f.get("peak_rows_by_decode_worker", {}).items()),
                        title="decode rows per worker (/health, polled)")
    down = f.get("decode_workers_seen_unhealthy") or []
    seen = f"decode workers /health listed unhealthy at least once: {', '.join(down) or 'none'}"
    return "\n\n".join([nodes, reqs, marks, rows, seen, *f["errors"]])


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, model="smollm2")
    p.add_argument("--streams", type=int, default=16, help="streams of the first wave")
    p.add_argument("--second-wave", type=int, default=8,
                   help="streams sent at once when the added node's worker serves (it takes some)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between two streams' starts")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rows", type=int, default=4, help="decode rows per engine (max_num_seqs)")
    p.add_argument("--node-loss", action=argparse.BooleanOptionalAction, default=True,
                   help="kill the added decode node once its worker serves (default on)")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="compare each stream with the engine alone, greedy (default on)")
    p.add_argument("--port", type=int, default=18001, help="the API's port (not 8000: a running ferry may have it)")
    p.add_argument("--gcs-port", type=int, default=0, help="0: a free one")
    p.add_argument("--added-wait", type=float, default=300.0,
                   help="most seconds from the burst's start the second wave waits for the added worker")
    p.add_argument("--node-timeout", type=float, default=180.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--down-timeout", type=float, default=240.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.streams < 1 or args.second_wave < 0 or args.interval < 0 or args.prompt_tokens < 1 or args.max_tokens < 1:
        p.error("--streams, --prompt-tokens and --max-tokens must be positive, --interval non-negative")
    run(bench, args, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
