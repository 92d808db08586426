"""Disaggregated serving on SmolLM2-135M with a shared system prompt: prefix-cache pool, KV bytes, latency.

Everything runs as Ray actors on one local cluster (the embedded default plus what a figure needs):
- colocated vs disaggregated: the same chat requests (one ~250-token system prompt, opted into
  sharing, and a short question each; greedy, `--max-tokens`) first one at a time, then as a burst
  of `--concurrency`, against 1 colocated actor (2 torch threads) and against 1 prefill + 1 decode
  actor (1 thread each: the same 2 cores). TTFT = submit -> first token at the caller; TPOT = (last
  token - first token) / (tokens - 1). One warm-up request each first, so both have the system
  prompt in their engine's own prefix cache, as in steady state.
- pool hit vs miss: a second prefill worker whose own cache is cold serves tenants whose prefix
  (salted per tenant, not shared) the first prefill worker already offered to the pool (hit), and
  new tenants (miss), one request at a time; the same tenants once more give the local-hit figure.
- KV bytes moved per request by prefill workers configured with none / int8 / fp8 (header
  included, from the transport's send stats), and whether greedy outputs still equal the exact run.
- codecs (bench/pd_codecs.py): at real lengths (`--codec-lengths`, windows of this repository's
  docs), transfer + codec time per request with none / int8 / fp8 fixed and with auto (the
  per-transfer choice), on every link measurable here (in-process, Ray object store, NIXL over
  loopback) plus an EMULATED slower link, and the check "auto <= best fixed codec" per link.

    .venv/bin/python bench/pd.py [--parts serve,codecs] [--requests 8] [--concurrency 4] [--max-tokens 16]
        [--codec-lengths 1024,2048,4096] [--codec-rounds 3] [--emulated-gbps 1.25] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    # `python bench/pd.py` puts bench/ first on the path; import from the repository root instead.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every Ray port on 127.0.0.1

import ray

from actors.engine.config import EngineConfig
from actors.engine.fetch import resolve_model
from actors.engine.sampling import SamplingParams
from actors.engine.tokenizer import Tokenizer
from actors.messages import GenerationRequest, PrefillResult, TokenEvent
from actors.prefix_cache.store import PrefixCacheConfig
from actors.ray_actors import RemoteColocated, RemotePrefill, start_pd
from actors.worker_config import WorkerConfig, TenantKVPolicy
from bench.common import format_table, progress, run_on_local_ray
from bench.pd_codecs import LINK_KEYS, bench_codecs, render_codecs
from cluster.router.client import Router
from cluster.router.config import RouterConfig
from cluster.router.ray_handles import ray_handles, router_for

MODEL = "smollm2"
SYSTEM = (
    "You are Harbor, the support assistant of a regional ferry company. Answer questions from travellers "
    "about timetables, tickets, luggage, pets, bicycles, cars, accessibility and delays. Be brief and "
    "friendly: two or three sentences unless the traveller asks for detail. Never invent departure times; "
    "if you do not know a time, say so and point to the timetable page. Prices depend on the season: "
    "summer fares apply from June to August, winter fares from November to February, and shoulder fares "
    "otherwise. Children under six travel free, students and seniors get a third off, and groups of ten "
    "or more get a fifth off when booked a week ahead. Dogs travel on the outer deck or in the pet lounge, "
    "on a lead, with a ticket of their own. Bicycles are free outside rush hours. Cars must check in thirty "
    "minutes before departure, foot passengers ten minutes. If a crossing is cancelled for weather, tickets "
    "are valid on the next three departures or refunded in full. Wheelchair users can board by the car "
    "ramp; staff will help if told in advance. Lost property is kept for thirty days at the harbor office."
)
QUESTIONS = [
    "Can I bring my dog on the morning ferry?", "How much is a return ticket for a student in July?",
    "Is my bicycle free at eight in the morning?", "What happens if my crossing is cancelled?",
    "When do I need to arrive with my car?", "Do children pay for the ferry?",
    "I left my umbrella on the boat last week, what should I do?", "Can a wheelchair user board easily?",
    "Is there a discount for a group of twelve?", "What are the winter fares?",
    "Can I take my bike on the evening ferry?", "How early should foot passengers arrive?",
]
CLIENT = RouterConfig(call_timeout_s=60, prefill_timeout_s=120, token_timeout_s=120)


def chat(tok: Tokenizer, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return tok.encode(text, add_special_tokens=False)


def common_prefix_len(seqs: Sequence[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    return next((i for i in range(n) if len({s[i] for s in seqs}) > 1), n)


@dataclasses.dataclass
class Sample:
    ttft_s: float
    tpot_s: float
    token_ids: list[int]
    first_emitted_at: float  # wall clock, by the worker that produced the first token
    result: PrefillResult | None = None


Streamer = Callable[[GenerationRequest], AsyncIterator[TokenEvent]]


async def measure(stream: Streamer, req: GenerationRequest) -> Sample:
    t0 = time.perf_counter()
    req = dataclasses.replace(req, arrival_time=time.time())
    times, ids, emitted = [], [], []
    async for event in stream(req):
        emitted.append(event.emitted_at)
        times.extend([time.perf_counter()] * len(event.output.new_token_ids))
        ids.extend(event.output.new_token_ids)
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return Sample(times[0] - t0, tpot, ids, emitted[0])


async def run_all(stream: Streamer, reqs: Sequence[GenerationRequest], concurrency: int) -> list[Sample]:
    gate = asyncio.Semaphore(concurrency)

    async def one(req: GenerationRequest) -> Sample:
        async with gate:
            return await measure(stream, req)

    return list(await asyncio.gather(*(one(r) for r in reqs)))


def pd_stream(client: Router) -> Streamer:
    return client.generate


def colocated_stream(actor: Any) -> Streamer:
    async def stream(req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        async for ref in actor.generate.options(num_returns="streaming").remote(req):
            yield await ref
    return stream


async def run_pd(client: Router, reqs: Sequence[GenerationRequest], concurrency: int) -> list[Sample]:
    samples = await run_all(pd_stream(client), reqs, concurrency)
    for req, s in zip(reqs, samples):
        s.result = client.prefill_result(req.request_id)
    return samples


def latency(samples: Sequence[Sample]) -> dict[str, Any]:
    ttft, tpot = [s.ttft_s for s in samples], [s.tpot_s for s in samples]
    out: dict[str, Any] = {
        "ttft_ms_p50": 1e3 * statistics.median(ttft), "ttft_ms_mean": 1e3 * statistics.mean(ttft),
        "tpot_ms_p50": 1e3 * statistics.median(tpot), "tpot_ms_mean": 1e3 * statistics.mean(tpot),
        "num_requests": len(samples)}
    results = [s.result for s in samples if s.result]
    if results:  # where a disaggregated TTFT goes, up to the KV sitting in the decode worker's buffers
        stages = {stage: 1e3 * statistics.mean(getattr(r, f"{stage}_s") for r in results)
                  for stage in ("queued", "lookup", "compute", "transfer")}
        # KV in the decode worker's buffers -> first token: land (one engine-lock wait), commit, one step
        stages["decode_first"] = 1e3 * statistics.mean(s.first_emitted_at - s.result.finished_at
                                                       for s in samples if s.result)
        out["stages_ms_mean"] = stages
    return out


def requests(prompts: Sequence[list[int]], params: SamplingParams, tag: str, tenant: str | Sequence[str],
             shared: int = 0) -> list[GenerationRequest]:
    tenants = [tenant] * len(prompts) if isinstance(tenant, str) else list(tenant)
    return [GenerationRequest(f"{tag}-{i}", p, params, tenant=t, num_shared_prefix_tokens=shared)
            for i, (p, t) in enumerate(zip(prompts, tenants))]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    parts = set(args.parts.split(","))
    figures = await bench_serving(args) if "serve" in parts else {"model": MODEL}
    if "codecs" in parts:
        lengths = [int(n) for n in args.codec_lengths.split(",")]
        figures["codecs"] = await bench_codecs(lengths, args.codec_rounds, args.emulated_gbps,
                                               args.codec_links.split(","))
    return figures


async def bench_serving(args: argparse.Namespace) -> dict[str, Any]:
    tok = Tokenizer.load(resolve_model(MODEL))
    prompts = [chat(tok, QUESTIONS[i % len(QUESTIONS)]) for i in range(args.requests)]
    shared = common_prefix_len(prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    cfg = WorkerConfig(model=MODEL, engine=EngineConfig(num_blocks=512), compression="none")  # the exact baseline
    figures: dict[str, Any] = {"model": MODEL, "config": {
        "requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "prompt_tokens": [len(p) for p in prompts], "shared_prefix_tokens": shared,
        "block_size": cfg.engine.block_size}}

    progress("colocated: starting 1 actor (2 torch threads)")
    colo = RemoteColocated.remote(cfg, "bench-colocated", 2)
    stream = colocated_stream(colo)
    await run_all(stream, requests(prompts[:1], params, "colo-warm", "bench", shared), 1)
    modes: dict[str, dict[str, Any]] = {}
    for arrival, conc in (("sequential", 1), ("burst", args.concurrency)):
        progress(f"colocated: {args.requests} requests, {arrival}")
        reqs = requests(prompts, params, f"colo-{arrival}", "bench", shared)
        modes[f"colocated/{arrival}"] = latency(await run_all(stream, reqs, conc))
    ray.kill(colo)

    progress("disaggregated: starting 2 prefill + 1 decode + 1 cache actor (1 torch thread each)")
    cache = PrefixCacheConfig(dram_bytes=256 << 20, disk_bytes=1 << 30)
    pd = start_pd(cfg, num_prefill=2, num_decode=1, cache=cache, num_cache=1, torch_threads=1)
    try:
        first, second = (router_for(pd, CLIENT, prefills=[name]) for name in pd.prefills)
        await run_pd(first, requests(prompts[:1], params, "pd-warm", "bench", shared), 1)
        exact: list[Sample] = []
        for arrival, conc in (("sequential", 1), ("burst", args.concurrency)):
            progress(f"disaggregated: {args.requests} requests, {arrival}")
            samples = await run_pd(first, requests(prompts, params, f"pd-{arrival}", "bench", shared), conc)
            modes[f"disaggregated/{arrival}"] = latency(samples)
            exact = exact or samples
        figures["colocated_vs_disaggregated"] = modes

        n = max(2, args.requests // 2)
        tenants = [f"tenant-{i}" for i in range(n)]
        progress(f"pool: {n} tenants warm the pool through prefill 0; prefill 1 serves hits, misses, local hits")
        await run_pd(second, requests([chat(tok, "Hello!")], params, "pool-warm1", "warm"), 1)
        await run_pd(first, requests(prompts[:n], params, "pool-offer", tenants), 1)
        assert await pd.prefills[list(pd.prefills)[0]].flush_offers.remote(60.0)
        later = prompts[1 : n + 1]
        pool_rows = {
            "miss": await run_pd(second, requests(later, params, "pool-miss", [f"new-{t}" for t in tenants]), 1),
            "pool hit": await run_pd(second, requests(later, params, "pool-hit", tenants), 1),
            "local hit": await run_pd(second, requests(prompts[2 : n + 2], params, "pool-local", tenants), 1),
        }
        figures["prefix_pool"] = {k: {**latency(v), "computed_tokens_mean": statistics.mean(
            s.result.num_computed_tokens for s in v if s.result), "pool_hit_blocks_mean": statistics.mean(
            s.result.num_pool_hit_blocks for s in v if s.result)} for k, v in pool_rows.items()}
        p = figures["prefix_pool"]
        p["ttft_ratio_miss_over_pool_hit"] = p["miss"]["ttft_ms_p50"] / p["pool hit"]["ttft_ms_p50"]

        figures["kv_bytes"] = {"none": kv_row(exact, exact)}
        decode_meta = await asyncio.wait_for(next(iter(pd.decodes.values())).transport_metadata.remote(), 60)
        for comp in ("int8", "fp8"):
            progress(f"compression {comp}: starting a prefill actor")
            name = f"bench-prefill-{comp}"
            lossy = dataclasses.replace(cfg, compression=comp, default_tenant_kv=TenantKVPolicy(fidelity="lossy"))
            actor = RemotePrefill.remote(lossy, name, None, 1)
            try:
                await asyncio.wait_for(actor.add_peer.remote(decode_meta), 120)
                client = Router(ray_handles({name: actor}), ray_handles(pd.decodes), CLIENT)
                await run_pd(client, requests(prompts[:1], params, f"{comp}-warm", "bench", shared), 1)
                samples = await run_pd(client, requests(prompts, params, f"kv-{comp}", "bench", shared), 1)
                figures["kv_bytes"][comp] = kv_row(samples, exact)
            finally:
                ray.kill(actor)
    finally:
        pd.shutdown()
    return figures


def kv_row(samples: Sequence[Sample], exact: Sequence[Sample]) -> dict[str, float]:
    results = [s.result for s in samples if s.result]
    same = sum(a.token_ids == b.token_ids for a, b in zip(samples, exact))
    return {"raw_bytes_mean": statistics.mean(r.kv_raw_bytes for r in results),
            "wire_bytes_mean": statistics.mean(r.kv_wire_bytes for r in results),
            "transfer_ms_p50": 1e3 * statistics.median(r.transfer_s for r in results),
            "outputs_equal_to_none": same / len(samples)}


def render(f: dict[str, Any]) -> str:
    out = [render_serving(f)] if "config" in f else []
    if "codecs" in f:
        out.append(render_codecs(f["codecs"]))
    return "\n\n".join([*out, f"wall {f['wall_s']:.0f} s"])


def render_serving(f: dict[str, Any]) -> str:
    c = f["config"]
    rows = [[mode, d["ttft_ms_p50"], d["ttft_ms_mean"], d["tpot_ms_p50"], d["tpot_ms_mean"]]
            for mode, d in f["colocated_vs_disaggregated"].items()]
    t1 = format_table(["mode / arrival", "TTFT p50 ms", "TTFT mean ms", "TPOT p50 ms", "TPOT mean ms"], rows,
                      title=f"Colocated vs disaggregated, same {c['requests']} requests (burst = {c['concurrency']} "
                            f"in flight), {c['max_tokens']} tokens each")
    p = f["prefix_pool"]
    rows = [[k, v["ttft_ms_p50"], v["computed_tokens_mean"], v["pool_hit_blocks_mean"]]
            for k, v in p.items() if isinstance(v, dict)]
    t2 = format_table(["prefill 1, per tenant", "TTFT p50 ms", "computed tokens", "pool blocks"], rows,
                      title=f"Prefix-cache pool on a cold prefill worker: TTFT miss / pool hit = "
                            f"{p['ttft_ratio_miss_over_pool_hit']:.2f}x")
    k = f["kv_bytes"]
    rows = [[comp, v["raw_bytes_mean"] / 1e6, v["wire_bytes_mean"] / 1e6, v["raw_bytes_mean"] / v["wire_bytes_mean"],
             v["transfer_ms_p50"], f"{100 * v['outputs_equal_to_none']:.0f}%"] for comp, v in k.items()]
    t3 = format_table(["compression", "KV raw MB/req", "on wire MB/req", "raw/wire", "transfer p50 ms",
                       "greedy = none"], rows, title="KV moved prefill -> decode per request (fp32 KV)")
    stages = [[mode, *d["stages_ms_mean"].values()] for mode, d in f["colocated_vs_disaggregated"].items()
              if "stages_ms_mean" in d]
    t1 += "\n\n" + format_table(
        ["disaggregated / arrival", "queued ms", "lookup ms", "compute ms", "transfer ms", "decode first ms"], stages,
        title="Where disaggregated TTFT goes (means; queued = submit -> prefill starts, incl. the announce)")
    foot = (f"prompts {min(c['prompt_tokens'])}-{max(c['prompt_tokens'])} tokens, shared system prefix "
            f"{c['shared_prefix_tokens']} tokens, block {c['block_size']}")
    return "\n\n".join([t1, t2, t3, foot])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--parts", default="serve,codecs", help="serve (latency, pool, KV bytes), codecs")
    parser.add_argument("--codec-lengths", default="1024,2048,4096", help="codecs: prompt tokens, real text")
    parser.add_argument("--codec-rounds", type=int, default=3, help="codecs: sends of every prompt per policy")
    parser.add_argument("--codec-links", default=",".join(LINK_KEYS),
                        help="codecs: links to measure (nixl only where it imports)")
    parser.add_argument("--emulated-gbps", type=float, default=1.25,
                        help="codecs: rate of the EMULATED link (throttled in-process transport), GB/s")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    args = parser.parse_args()
    if args.requests < 4 or args.max_tokens < 2:
        parser.error("--requests must be >= 4 and --max-tokens >= 2")
    run_on_local_ray(bench, args, render)


if __name__ == "__main__":
    main()
