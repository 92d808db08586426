"""`ferry bench serve` / `python -m bench.serve`: arguments, one run per system and rate, the sweep.

Mental model: build the workload once (trace or synthetic arrivals, scaled), then for each system
either use `--url` (one already-running loopback server) or launch the peers named in `--systems`
one after another (never two at once: they would share the 2 cores), replay the workload at each
rate of the sweep (or `--rate` alone) and summarise. Defaults fit a whole four-system run in about
10 minutes on 2 cores: Azure conversation trace, lengths x0.1 clipped to 1024, 16 concurrent
clients, 45 s per rate. Exit code 0 when at least one system ran, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import shlex
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.loadgen.arrivals import synthetic_workload
from bench.loadgen.bound import PrefillBound, measure_prefill_bound
from bench.loadgen.client import ClientConfig, check_loopback, replay
from bench.loadgen.metrics import Slo, summarize
from bench.loadgen.peers import ALL_PEERS, PeerSpec, PeerUnavailable, health_figures, launched, served_model
from bench.loadgen.report import (RatePoint, SystemResult, machine, memory_table, plot, stage_table, table, tenant_table,
                                  write_json, write_results_md)
from bench.loadgen.prefix_tiers import pool_delta, tier_tokens
from bench.loadgen.probe import PROBE_PROMPT, probe
from bench.loadgen.stages import fetch_timelines, summarize_stages
from bench.loadgen.workload import (BenchRequest, assign_tenants, load_trace, rescale_rate, resolve_trace,
                                    scale_lengths)

log = logging.getLogger(__name__)
DEFAULT_GGUF = Path.home() / ".cache" / "ferry" / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="one running loopback server (base URL); else --systems are launched")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first /v1/models id)")
    p.add_argument("--systems", default=",".join(ALL_PEERS), help=f"peers to launch, of {','.join(ALL_PEERS)}")
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="the one model file every peer serves")
    p.add_argument("--ferry-src", type=Path, default=None,
                   help="run ferry peers from this source tree (e.g. a `git archive HEAD` snapshot)")
    p.add_argument("--ferry-dtype", default="auto",
                   help="the ferry peers' engine dtype: auto (bfloat16 where the CPU has native bf16, else "
                        "float32), float32, bfloat16; a --ferry-src older than dtype auto needs one named")
    p.add_argument("--ferry-stream-interval", type=int, default=1,
                   help="the ferry peers' stream_interval: tokens per streamed delta after the first (TTFT and "
                        "TPOT unchanged, ITL coarser, less CPU per token between the workers and the client)")
    p.add_argument("--ferry-local-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="ferry-disagg's decode workers may prefill for themselves when the prefill workers are "
                        "queued (scheduler.local_prefill, on in deploy/serve.yaml)")
    p.add_argument("--ferry-lend-cores", action=argparse.BooleanOptionalAction, default=False,
                   help="ferry's decode engines yield a node's cores to a prefill while their rows are ahead of "
                        "their TPOT targets (engine.lend_cores, off by default)")
    p.add_argument("--ferry-preempt-batch", action=argparse.BooleanOptionalAction, default=True,
                   help="ferry-disagg's interactive requests may take the decode rows of batch-class ones "
                        "(scheduler.preempt_batch; see --tenants and --batch-slo)")
    p.add_argument("--ferry-torch-threads", type=int, default=None,
                   help="threads each ferry engine's kernels use (default: the app splits the CPUs among them)")
    p.add_argument("--ferry-workers-as", choices=["deployments", "actors"], default=None,
                   help="ferry's workers as Serve deployments (the app's default) or plain actors")
    p.add_argument("--ferry-kv-recovery", choices=["shadow", "recompute"], default=None,
                   help="every tenant's scheduler kv_recovery: shadow (KV copied to the prefix pool as it fills, "
                        "the app's default) or recompute (nothing copied)")
    p.add_argument("--ferry-speculation", choices=["off", "ngram", "early_exit"], default=None,
                   help="ferry's engine.speculation.method (default: the app's)")
    p.add_argument("--parallel", type=int, default=16, help="slots / max batch for every peer, and client concurrency")
    p.add_argument("--trace", default="azure", help="azure, mooncake, a .csv/.jsonl path, or 'none' (fixed lengths)")
    p.add_argument("--arrivals", choices=["trace", "poisson", "gamma"], default="trace")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, <1 burstier)")
    p.add_argument("--rate", type=float, default=2.0, help="mean request rate (rps) the arrivals are scaled to")
    p.add_argument("--sweep", default=None, help="comma-separated rates; reports the goodput knee")
    p.add_argument("--knee-attainment", type=float, default=0.9, help="attainment a rate must reach to count")
    p.add_argument("--trace-start", type=int, default=0,
                   help="skip the trace's first N requests (Mooncake shares prefixes more often later on)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply the trace's prompt and output lengths (1: production lengths, clipped below)")
    p.add_argument("--max-prompt-len", type=int, default=1024, help="clip prompts to this (0: no clip of its own)")
    p.add_argument("--max-model-len", type=int, default=1152, help="clip prompt + output to this")
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--short-prompts", action="store_true",
                   help="the former default workload: lengths x0.1, prompt + output <= 1024, output <= 64 "
                        "(prompts of ~100 tokens hide capacity problems: compare with it, do not judge by it)")
    p.add_argument("--prefill-bound", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the machine's prefill bound first (ferry's engine, all cores, the workload's "
                        "mean prompt length) and report each system's knee as a fraction of it")
    p.add_argument("--input-len", type=int, default=128, help="prompt length without a trace")
    p.add_argument("--output-len", type=int, default=32, help="output length without a trace")
    p.add_argument("--slo", default="ttft:3000,tpot:200",
                   help="ttft:MS,tpot:MS[,e2el:MS] for every tenant (default: the real-length goodput targets)")
    p.add_argument("--tenants", default="t0,t1", help="comma-separated tenants, assigned round-robin")
    p.add_argument("--batch-slo", default=None, help="if set, the 2nd tenant is class 'batch' with these SLOs")
    p.add_argument("--max-concurrency", type=int, default=None, help="default: --parallel")
    p.add_argument("--num-requests", type=int, default=400, help="most requests per rate")
    p.add_argument("--duration", type=float, default=45.0, help="seconds of sending per rate")
    p.add_argument("--grace", type=float, default=20.0, help="seconds in-flight requests may finish after it")
    p.add_argument("--warmup", type=int, default=16,
                   help="requests sent to each system before its first rate, all at once and not measured "
                        "(with other prompts than the measured ones, so no prefix cache is warmed for them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path.home() / ".cache" / "ferry" / "bench")
    p.add_argument("--results-md", type=Path, default=None, help="also write this RESULTS.md")
    p.add_argument("--note", action="append", default=[], help="a line for RESULTS.md's notes")
    p.add_argument("--json", action="store_true",
                   help="print the figures (results.json) on stdout instead of the table; the rest goes to stderr")


def build_workload(a: argparse.Namespace, rate: float) -> tuple[list[BenchRequest], str]:
    n = a.num_requests
    base: list[BenchRequest] = []
    desc = "fixed lengths"
    if a.trace != "none":
        path = resolve_trace(a.trace)
        base = load_trace(path, limit=None if a.arrivals != "trace" else n + a.trace_start)
        if a.trace_start:
            base = base[a.trace_start:]
            t0 = base[0].arrival_s if base else 0.0
            base = [replace(r, arrival_s=r.arrival_s - t0) for r in base]
        base = scale_lengths(base, a.length_scale, a.max_model_len, a.max_output_len, a.max_prompt_len or None)
        clip = f"prompt <= {a.max_prompt_len}, " if a.max_prompt_len else ""
        start = f" from request {a.trace_start}" if a.trace_start else ""
        desc = (f"{path.name}{start}, lengths x{a.length_scale:g} clipped to {clip}output <= {a.max_output_len}, "
                f"prompt + output <= {a.max_model_len}")
    if a.arrivals == "trace" and base:
        # Scale only the prefix that fits the time bound, so what is sent really averages `rate`
        # (a trace's rate drifts over an hour; scaling all of it would not bound this window).
        k = max(2, min(len(base), math.ceil(rate * a.duration) + 1))
        reqs = rescale_rate(base[:k], rate)
        desc += f", trace arrivals time-scaled to {rate:g} rps"
    else:
        bursty = a.burstiness if a.arrivals == "gamma" else 1.0
        reqs = synthetic_workload(n, rate, bursty, a.seed, base or None, a.input_len, a.output_len)
        desc += f", {a.arrivals} arrivals at {rate:g} rps (burstiness {bursty:g})"
    tenants = [t for t in a.tenants.split(",") if t]
    classes = ["default", "batch"] if a.batch_slo else ["default"]
    return assign_tenants(reqs, tenants, classes), desc


def prompt_salt(seed: int, rate_index: int | None) -> int:
    """The prompt salt of one rate of a sweep (None: the warm-up). Each rate gets its own, so no
    rate finds its prompts already cached by an earlier one: a server with a prefix cache would
    otherwise skip the prefill of every request it saw before. Prefixes shared by design (Mooncake
    hash ids) are still shared within a rate."""
    return seed * 10_000 + (0 if rate_index is None else 1 + rate_index)


def _warm_up(a: argparse.Namespace, name: str, url: str, model: str, rate: float) -> None:
    """Lazy work on a server's first requests (kernel builds, allocator growth, caches filling) is
    not what a rate measures: send `--warmup` requests first, concurrently, and drop their records."""
    if a.warmup <= 0:
        return
    reqs, _ = build_workload(a, rate)
    burst = [replace(r, arrival_s=0.0) for r in reqs[: a.warmup]]
    cfg = ClientConfig(url=url, model=model, max_concurrency=a.max_concurrency or a.parallel,
                       max_requests=len(burst), duration_s=1.0, grace_s=max(a.grace, 30.0), salt=prompt_salt(a.seed, None))
    records, _ = asyncio.run(replay(cfg, burst))
    print(f"  {name} warm-up: {sum(r.success for r in records)} of {len(burst)} requests answered",
          file=sys.stderr, flush=True)


def _run_rates(a: argparse.Namespace, url: str, model: str, rates: list[float], slos: dict[str, Slo],
               result: SystemResult) -> None:
    _warm_up(a, result.name, url, model, rates[0])
    for i, rate in enumerate(rates):
        reqs, _ = build_workload(a, rate)
        cfg = ClientConfig(url=url, model=model, max_concurrency=a.max_concurrency or a.parallel,
                           max_requests=a.num_requests, duration_s=a.duration, grace_s=a.grace,
                           salt=prompt_salt(a.seed, i))
        before = health_figures(url)
        records, dur = asyncio.run(replay(cfg, reqs))
        s = summarize(records, dur, slos)
        stages = summarize_stages(records, fetch_timelines(url, records), dur)
        after = health_figures(url)
        if stages is not None:
            stages.update(tier_tokens(stages, pool_delta(before.pool, after.pool), after.block_size or before.block_size))
        preemptions = None
        if before.preemptions is not None and after.preemptions is not None:
            preemptions = (after.preemptions[0] - before.preemptions[0], after.preemptions[1] - before.preemptions[1])
        memory = {w: (before.memory_mib.get(w), after.memory_mib.get(w))
                  for w in sorted(before.memory_mib.keys() | after.memory_mib.keys())}
        result.points.append(RatePoint.of(rate, s, records, memory, preemptions, stages, after.workers))
        print(f"  {result.name} @ {rate:g} rps: sent {s.num_sent}, ok {s.completed}, goodput {s.goodput:.3f} rps, "
              f"attainment {s.attainment:.2f}, P99 TTFT {s.ttft_ms['p99']:.0f} ms, P99 TPOT {s.tpot_ms['p99']:.0f} ms; "
              f"answered but over TTFT {s.missed['ttft']}, over TPOT {s.missed['tpot']}"
              + (f"; workers P/D {result.points[-1].worker_counts()}" if result.points[-1].workers else "")
              + (f"; {s.failures_text()}" if s.failed else ""),
              file=sys.stderr, flush=True)


def _probed(res: SystemResult, url: str, model: str) -> bool:
    """Asks the greedy probe (bench/loadgen/probe.py) and keeps the answer; False (the system is
    skipped, with the answer as the reason) when it is not sensible."""
    res.probe = probe(url, model)
    print(f"  {res.name} probe: {PROBE_PROMPT!r} -> {res.probe.text!r}", file=sys.stderr, flush=True)
    if not res.probe.sensible:
        res.skipped = f"greedy probe not sensible ({res.probe.why}): {res.probe.text[:200]!r}"
        print(f"[bench] {res.name}: SKIPPED: {res.skipped}", file=sys.stderr, flush=True)
    return res.probe.sensible


def _prefill_bound(a: argparse.Namespace, rate: float) -> PrefillBound | None:
    if not a.prefill_bound:
        return None
    reqs, _ = build_workload(a, rate)
    mean_prompt = sum(r.prompt_len for r in reqs) / max(1, len(reqs))
    mean_output = sum(r.output_len for r in reqs) / max(1, len(reqs))
    print(f"[bench] measuring the prefill and compute bounds ({mean_prompt:.0f}-token prompts, {a.ferry_dtype}; "
          f"decode at {a.parallel} rows)", file=sys.stderr, flush=True)
    bound = measure_prefill_bound(a.gguf, a.ferry_dtype, mean_prompt, mean_output_tokens=mean_output,
                                  decode_rows=a.parallel)
    print(f"[bench] {bound.describe()}", file=sys.stderr, flush=True)
    return bound


def apply_short_prompts(a: argparse.Namespace) -> None:
    """--short-prompts: the former default workload's lengths."""
    if a.short_prompts:
        a.length_scale, a.max_prompt_len, a.max_model_len, a.max_output_len = 0.1, 0, 1024, 64


def add_ferry_command(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Adds `ferry bench serve` to ferry's subcommands (the `ferry.commands` entry point in
    pyproject.toml: deploy/cli.py loads it without importing bench/)."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_cmd", required=True)
    srv = bench.add_parser("serve", help="replay a trace against OpenAI-compatible servers; goodput, P99s, peers")
    add_arguments(srv)
    srv.set_defaults(func=run_bench)


def run_bench(a: argparse.Namespace) -> int:
    apply_short_prompts(a)
    rates = [float(r) for r in a.sweep.split(",")] if a.sweep else [a.rate]
    slos = {"default": Slo.parse(a.slo)}
    if a.batch_slo:
        slos["batch"] = Slo.parse(a.batch_slo)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = a.out / stamp
    out.mkdir(parents=True, exist_ok=True)
    results: list[SystemResult] = []
    bound = _prefill_bound(a, max(rates))  # the rate sending the most requests: the steadiest mean
    if a.url:
        check_loopback(a.url)
        model = a.model or served_model(a.url)
        if model is None:
            print(f"[bench] {a.url}: GET /v1/models did not answer with a model; pass --model", file=sys.stderr)
            return 1
        res = SystemResult(a.url)
        results.append(res)
        if _probed(res, a.url, model):
            _run_rates(a, a.url, model, rates, slos, res)
    else:
        spec = PeerSpec(gguf=a.gguf, parallel=a.parallel, ctx_per_slot=a.max_model_len, ferry_src=a.ferry_src,
                        ferry_dtype=a.ferry_dtype, ferry_stream_interval=a.ferry_stream_interval,
                        slo_ttft_ms=slos["default"].ttft_ms, slo_tpot_ms=slos["default"].tpot_ms,
                        ferry_local_prefill=a.ferry_local_prefill, ferry_preempt_batch=a.ferry_preempt_batch,
                        ferry_lend_cores=a.ferry_lend_cores,
                        ferry_torch_threads=a.ferry_torch_threads, ferry_workers_as=a.ferry_workers_as,
                        ferry_kv_recovery=a.ferry_kv_recovery, ferry_speculation=a.ferry_speculation)
        for name in [s for s in a.systems.split(",") if s]:
            res = SystemResult(name)
            results.append(res)
            print(f"[bench] {name}: starting", file=sys.stderr, flush=True)
            try:
                with launched(name, spec, out / "logs") as (url, model):
                    if _probed(res, url, a.model or model):
                        _run_rates(a, url, a.model or model, rates, slos, res)
            except PeerUnavailable as e:
                res.skipped = str(e)[:400]
                print(f"[bench] {name}: SKIPPED: {res.skipped}", file=sys.stderr, flush=True)
    _, desc = build_workload(a, rates[0])
    prog = "python -m bench.serve" if sys.argv[0].endswith(("serve.py", "bench.serve")) else "ferry"
    meta = {"machine": machine(), "command": " ".join([prog, *(shlex.quote(x) for x in sys.argv[1:])]),
            "workload": f"{desc}; {a.max_concurrency or a.parallel} concurrent clients, {a.parallel} slots per server, "
                        f"<= {a.num_requests} requests and {a.duration:g} s (+{a.grace:g} s grace) per rate",
            "slo": {k: ", ".join(f"{f[:-3].upper()} <= {getattr(v, f):g} ms" for f in ("ttft_ms", "tpot_ms", "e2el_ms")
                                 if getattr(v, f) is not None) for k, v in slos.items()}, "rates": rates, "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "parallel": a.parallel, "prefill_bound": bound.to_dict() if bound else None}
    write_json(results, meta, out / "results.json")
    pngs = plot(results, a.knee_attainment, out)
    notes = sys.stderr if a.json else sys.stdout
    bound_rps = bound.rps if bound else None
    compute_rps = bound.compute_rps if bound else None
    print((out / "results.json").read_text() if a.json else table(results, a.knee_attainment, bound_rps, compute_rps))
    if bound and not a.json:
        print(bound.describe())
    tenants = tenant_table(results)
    if tenants:
        print("\nper tenant (and batch rows preempted / resumed, the ingress's counts in /health):\n" + tenants,
              file=notes)
    stage_lines = stage_table(results)
    if stage_lines:
        print("\nwhere the time went (ms, medians unless named; from the server's request timelines):\n"
              + stage_lines, file=notes)
    memory = memory_table(results)
    if memory:
        print("\nworker memory (resident MiB, from /health) before and after each rate:\n" + memory, file=notes)
    print(f"results: {out / 'results.json'}" + "".join(f"\nplot: {p}" for p in pngs), file=notes)
    if a.results_md:
        write_results_md(results, meta, a.knee_attainment, a.results_md, a.note)
        print(f"wrote {a.results_md}", file=notes)
    return 0 if any(r.points for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    add_arguments(p)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM (a `timeout`, a job runner) unwinds like Ctrl-C, so the peer being measured is stopped
    # by its context manager instead of being left running without its harness.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return run_bench(p.parse_args(argv))
