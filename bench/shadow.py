"""KV shadowing on SmolLM2-135M: what it costs a decode worker, and what it saves a resumed request.

Two decode workers in this process (no Ray), each with its own engine, sharing a prefix-cache pool of
two in-process stores; prompts are windows of this repository's own docs, tokenized.
- overhead: `--rows` requests prefilled and decoded together on one worker (greedy, `--max-tokens`),
  with their KV shadowed to the pool and without; decode tokens/s is counted over the window where
  every row is decoding (after the last first token, until the first stream ends). Modes alternate,
  `--repeats` times each, and the median is reported.
- resume: one request of `--context` prompt tokens streams `--cut` tokens on worker A and is cut off
  (a preempted row, or its worker lost); worker B then resumes it, from its shadow blocks (import +
  the last partial block replayed) or by recomputing prompt + streamed tokens (`recompute`). Time to
  the resume's first new token, and whether the continuation equals an uninterrupted run's.

    .venv/bin/python bench/shadow.py [--rows 16] [--prompt-tokens 512] [--max-tokens 64] [--context 1000]
        [--cut 32] [--repeats 2] [--threads 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    _here = Path(__file__).resolve().parent  # import from the repository root, not bench/
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))


from actors.decode import DecodeWorker
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.fetch import resolve_model
from actors.engine.sampling import SamplingParams
from actors.engine.tokenizer import Tokenizer
from actors.handoff import kv_layout
from actors.messages import GenerationRequest
from actors.prefix_cache.handles import LocalStoreHandle
from actors.prefix_cache.pool import PrefixCachePool
from actors.prefix_cache.ring import StoreId
from actors.prefix_cache.store import PrefixCacheConfig, PrefixCacheStore
from actors.worker_config import WorkerConfig
from bench.common import bench_parser, format_table, progress, run
from transfer.config import TransferConfig, make_transport
from transfer.units import MIB

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/architecture.md", "bench/RESULTS.md")


def doc_tokens(tok: Tokenizer) -> list[int]:
    text = "\n\n".join((ROOT / p).read_text() for p in DOCS if (ROOT / p).is_file())
    return tok.encode(text, add_special_tokens=False)


def windows(tokens: list[int], n: int, count: int, start: int = 0) -> list[list[int]]:
    """`count` prompts of `n` tokens from `tokens`, at distinct offsets (wrapping around)."""
    step = max(1, (len(tokens) - n) // max(count, 1)) if len(tokens) > n else 1
    out = []
    for i in range(count):
        at = (start + i * step) % max(1, len(tokens) - n)
        w = tokens[at : at + n]
        out.append((w * (n // max(len(w), 1) + 1))[:n])
    return out


class Workers:
    """Two decode workers over one in-process pool."""

    def __init__(self, model: str, dtype: str, num_blocks: int, tmp: str) -> None:
        cfg = WorkerConfig(model=model, engine=EngineConfig(num_blocks=num_blocks, dtype=dtype, max_num_seqs=64),
                           transfer=TransferConfig(kind="local"))
        store_cfg = PrefixCacheConfig(dram_bytes=2048 * MIB, enable_disk=False, disk_dir=tmp)
        stores = {StoreId(f"s{i}"): LocalStoreHandle(PrefixCacheStore(store_cfg, f"s{i}")) for i in range(2)}
        self.pool = PrefixCachePool(stores, timeout_s=30.0)
        tag = uuid.uuid4().hex[:6]
        self.workers = []
        for i in range(2):
            engine = Engine.from_pretrained(model, cfg.engine)
            self.workers.append(DecodeWorker(cfg, AsyncEngine(engine), make_transport(f"sh{i}-{tag}", cfg.transfer),
                                             kv_layout(engine), prefix_pool=self.pool))

    def close(self) -> None:
        for w in self.workers:
            w.close()


async def _stream(worker: DecodeWorker, req: GenerationRequest, arrivals: list[float], ids: list[int],
                  cut: int | None = None) -> None:
    stream = worker.generate(req)
    async for event in stream:
        now = time.perf_counter()
        ids += event.output.new_token_ids
        arrivals += [now] * len(event.output.new_token_ids)
        if cut is not None and len(ids) >= cut:
            break
    await stream.aclose()


async def overhead_run(w: Workers, prompts: list[list[int]], params: SamplingParams, shadow: bool) -> float:
    """Decode tokens/s of one worker while every row decodes."""
    tag = uuid.uuid4().hex[:6]
    reqs = [GenerationRequest(f"o{tag}-{i}", p, params, tenant=f"t{tag}", shadow_salt=f"{tag}{i}" if shadow else None)
            for i, p in enumerate(prompts)]
    arrivals: list[list[float]] = [[] for _ in reqs]
    await asyncio.gather(*(_stream(w.workers[0], r, a, []) for r, a in zip(reqs, arrivals)))
    start = max(a[0] for a in arrivals)
    end = min(a[-1] for a in arrivals)
    tokens = sum(sum(1 for t in a if start < t <= end) for a in arrivals)
    w.workers[0].pool.flush(60.0)  # type: ignore[union-attr]
    return tokens / (end - start) if end > start else float("nan")


async def resume_run(w: Workers, prompt: list[int], params: SamplingParams, cut: int, shadow: bool) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:6]
    req = GenerationRequest(f"r{tag}", prompt, params, tenant=f"t{tag}", shadow_salt=tag)
    done: list[int] = []
    await _stream(w.workers[0], req, [], done, cut=cut)
    await asyncio.sleep(0.3)
    w.workers[0].pool.flush(60.0)  # type: ignore[union-attr]
    resumed = replace(req, request_id=f"{req.request_id}~r1", output_token_ids=tuple(done),
                      shadow_salt=tag if shadow else None)
    arrivals: list[float] = []
    rest: list[int] = []
    t0 = time.perf_counter()
    await _stream(w.workers[1], resumed, arrivals, rest)
    whole: list[int] = []
    await _stream(w.workers[1], replace(req, request_id=f"w{tag}", tenant=f"u{tag}", shadow_salt=None), [], whole)
    return {"first_token_s": arrivals[0] - t0, "identical": done + rest == whole}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = str(resolve_model(args.model))
    tok = Tokenizer.load(model)
    tokens = doc_tokens(tok)
    blocks = args.rows * -(-(args.prompt_tokens + args.max_tokens) // 16) + 4 * -(-(args.context + 256) // 16)
    with tempfile.TemporaryDirectory(prefix="ferry-shadow-") as tmp:
        w = Workers(model, args.dtype, blocks + 64, tmp)
        try:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
            rates: dict[str, list[float]] = {"off": [], "on": []}
            progress(f"overhead: {args.rows} rows of {args.prompt_tokens} prompt tokens, {args.max_tokens} out")
            for r in range(args.repeats):
                for mode in ("off", "on"):
                    prompts = windows(tokens, args.prompt_tokens, args.rows, start=r * 997 + (mode == "on") * 131)
                    rates[mode].append(await overhead_run(w, prompts, params, mode == "on"))
                    progress(f"  {mode}: {rates[mode][-1]:.1f} decode tokens/s")
            shadow_stats = w.workers[0].shadow_stats()
            rparams = SamplingParams(max_tokens=args.cut + 16, temperature=0, ignore_eos=True)
            resume: dict[str, list[dict[str, Any]]] = {"kv": [], "recompute": []}
            progress(f"resume: {args.context}-token context cut after {args.cut} tokens")
            for r in range(args.repeats):
                for mode in ("kv", "recompute"):
                    (prompt,) = windows(tokens, args.context, 1, start=r * 389 + (mode == "kv") * 53 + 7)
                    resume[mode].append(await resume_run(w, prompt, rparams, args.cut, mode == "kv"))
                    progress(f"  {mode}: first token {resume[mode][-1]['first_token_s'] * 1e3:.0f} ms")
        finally:
            w.close()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    kv_s = statistics.median(x["first_token_s"] for x in resume["kv"])
    re_s = statistics.median(x["first_token_s"] for x in resume["recompute"])
    return {
        "model": args.model,
        "config": {"rows": args.rows, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                   "context": args.context, "cut": args.cut, "repeats": args.repeats, "threads": args.threads,
                   "dtype": args.dtype},
        "decode_tokens_per_s_off": off, "decode_tokens_per_s_on": on, "shadow_overhead": 1 - on / off,
        "shadowed_blocks": shadow_stats.num_shadowed_blocks if shadow_stats else 0,
        "shadowed_mib": shadow_stats.num_shadowed_bytes / MIB if shadow_stats else 0,
        "deferred_steps": shadow_stats.num_deferred if shadow_stats else 0,
        "resume_first_token_s_kv": kv_s, "resume_first_token_s_recompute": re_s, "resume_ratio": kv_s / re_s,
        "resume_identical_kv": sum(x["identical"] for x in resume["kv"]),
        "resume_identical_recompute": sum(x["identical"] for x in resume["recompute"]),
        "resume_runs": args.repeats,
    }


def render(f: dict[str, Any]) -> str:
    c = f["config"]
    n = f["resume_runs"]
    rows = [
        ["decode tokens/s, shadows off", f["decode_tokens_per_s_off"]],
        ["decode tokens/s, shadows on", f["decode_tokens_per_s_on"]],
        ["shadowing overhead", f"{f['shadow_overhead'] * 100:.1f}%"],
        ["blocks shadowed (MiB)", f"{f['shadowed_blocks']} ({f['shadowed_mib']:.0f})"],
        ["resume first token, from KV (s)", f["resume_first_token_s_kv"]],
        ["resume first token, recompute (s)", f["resume_first_token_s_recompute"]],
        ["resume from KV / recompute", f["resume_ratio"]],
        ["identical continuations, from KV", f"{f['resume_identical_kv']}/{n}"],
        ["identical continuations, recompute", f"{f['resume_identical_recompute']}/{n}"],
    ]
    return format_table(["figure", "value"], rows, title=(
        f"KV shadows, {f['model']} {c['dtype']}, {c['threads']} threads: {c['rows']} rows x {c['prompt_tokens']} "
        f"prompt tokens, {c['max_tokens']} out; resume at {c['context']} + {c['cut']} tokens; median of {c['repeats']}"))


def main() -> None:
    parser = bench_parser(__doc__, model="smollm2", dtype="bfloat16", threads=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--cut", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if min(args.rows, args.prompt_tokens, args.max_tokens, args.context, args.cut, args.repeats, args.threads) < 1:
        parser.error("every count must be >= 1")
    if args.dtype not in ("bfloat16", "float32"):
        parser.error("--dtype: bfloat16 or float32")
    run(bench, args, render)


if __name__ == "__main__":
    main()
