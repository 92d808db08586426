"""Request-aware KV paging vs ferry's lazy paging, on the real lengths of the Azure conversation trace.

What runs: the engine's own `Scheduler` and `KVCacheManager` (no model: a step's "forward" marks its
tokens computed and samples a fixed token id), once per paging policy, in the same process, on the
same requests: the first `--requests` of `azure_llm_2023_conv.csv` (read in place from the shared
traces folder), prompt and output lengths unscaled (ContextTokens, GeneratedTokens: mean 1,155 and
211 tokens), all queued at once so the KV budget binds, and `max_tokens` = the trace's output
length (a client that knows how long its answer is: the most request-aware paging can know).
Budget: `--kv-tokens` of KV (blocks of `--block-size`), `--max-seqs` rows, `--step-tokens` per step.

Policies: `lazy` (ferry's default: blocks from the free queue as tokens need them); `aware-soft`
(request-aware: requests expected >= `--long-tokens` take contiguous runs, holding `--run-blocks`
ahead, holds lent to others when needed); `aware-hard` (the same with hard holds: reserved);
`reserve-max` (every request reserves blocks for its whole prompt + max_tokens when admitted, so
it never grows or is preempted: static reservation, which paging is usually compared with; here
`max_tokens` is the exact output length, the best case for it).

Reported per policy, over the steps in which requests were waiting (the budget binding):
admitted concurrency (running requests, mean), ratio to lazy, preemptions and recomputed tokens,
output tokens per step, internal fragmentation (slots in allocated or hard-held blocks without KV),
held blocks, contiguity (share of a table's neighbouring blocks whose ids follow each other), and decode
attention time: the native CPU kernel (kernels/cpu_native.py, one thread, caches flushed before each
call) over the decode rows' real block tables at fixed steps, per 1k context tokens, against the
same rows laid out contiguously. `bound` is the most any placement policy could add to lazy's
concurrency at this budget: lazy holds only blocks with KV, so at most its fragmentation is saved.

Run:
    python bench/paging.py [--json] [--requests 1500] [--kv-tokens 131072] [--long-tokens 1024]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.config import EngineConfig  # noqa: E402
from actors.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from actors.engine.paging import PagingPolicy  # noqa: E402
from actors.engine.request import Request, RequestStatus  # noqa: E402
from actors.engine.sampling import SamplingParams, SamplingState  # noqa: E402
from actors.engine.scheduler import Scheduler  # noqa: E402
from bench.common import bench_parser, format_table, progress, run  # noqa: E402
from bench.sim.traces import TraceRequest, load_azure_conv  # noqa: E402
from kernels.cpu_native import library, paged_decode_attention_native  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention shape (one layer timed)


@dataclass
class Snapshot:
    tables: list[list[int]]  # decode rows' block ids
    seq_lens: list[int]  # their context lengths (tokens with KV, the new one included)


@dataclass
class SimResult:
    name: str
    steps: int = 0
    saturated_steps: int = 0
    running: list[int] = field(default_factory=list)  # per saturated step
    frag: list[float] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    output_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    contiguity: list[float] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    prefix_hit_tokens: int = 0
    paging: dict[str, int] = field(default_factory=dict)


class ReservingKV(KVCacheManager):
    """Static reservation: a request's first allocation takes blocks for prompt + max_tokens."""

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list | None = None) -> bool:
        if not self.num_held_blocks(request.request_id):
            done = request.num_computed_tokens + len(computed_blocks or []) * self.block_size
            num_new_tokens = max(num_new_tokens, request.num_prompt_tokens + request.params.max_tokens - done)
        return super().allocate_slots(request, num_new_tokens, computed_blocks)


def policies(long_tokens: int, run_blocks: int) -> dict[str, PagingPolicy]:
    return {
        "lazy": PagingPolicy(),
        "aware-soft": PagingPolicy("request_aware", long_tokens, run_blocks),
        "aware-hard": PagingPolicy("request_aware", long_tokens, run_blocks, hard_holds=True),
        "reserve-max": PagingPolicy(),  # lazy placement; `ReservingKV` reserves
    }


def make_requests(trace: list[TraceRequest], block_size: int, seed: int = 0) -> list[Request]:
    """Distinct random prompts (the trace carries no content: no prefix is shared)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, t in enumerate(trace):
        prompt = rng.integers(4, 32000, t.prompt_len).tolist()
        params = SamplingParams(max_tokens=t.output_len, temperature=0, ignore_eos=True)
        out.append(Request(f"r{i}", prompt, SamplingState(params, 0, prompt), block_size))
    return out


def contiguity(tables: list[list[int]]) -> float:
    pairs = sum(len(t) - 1 for t in tables)
    follow = sum(1 for t in tables for a, b in zip(t, t[1:]) if b == a + 1)
    return follow / pairs if pairs else 1.0


def simulate(name: str, policy: PagingPolicy, reqs: list[Request], args: argparse.Namespace) -> SimResult:
    bs = args.block_size
    cfg = EngineConfig(block_size=bs, num_blocks=args.kv_tokens // bs, max_num_seqs=args.max_seqs,
                       max_num_batched_tokens=args.step_tokens, kv_paging=policy)
    manager = ReservingKV if name == "reserve-max" else KVCacheManager
    kv = manager(args.kv_tokens // bs, bs, not args.no_prefix_caching, paging=policy)
    sched = Scheduler(cfg, kv)
    for r in reqs:
        sched.add(r)
    res = SimResult(name)
    snap_at = set(args.snapshot_steps)
    while sched.has_unfinished():
        saturated = bool(sched.waiting)
        batch = sched.schedule()
        res.steps += 1
        if res.steps in snap_at:
            rows = [(r, n) for r, n in zip(batch.requests, batch.num_new_tokens) if n == 1 and r.num_computed_tokens > 0]
            res.snapshots.append(Snapshot([kv.block_ids(r.request_id) for r, _ in rows],
                                          [r.num_computed_tokens + 1 for r, _ in rows]))
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            req.num_forwarded_tokens += n
            kv.cache_computed_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(7)
                res.output_tokens += 1
                if req.num_output_tokens >= req.params.max_tokens:
                    sched.finish(req, RequestStatus.FINISHED_LENGTH)
        if saturated:
            res.saturated_steps += 1
            res.running.append(len(sched.running))
            live = sum(r.num_computed_tokens for r in sched.running)
            used = sum(kv.num_held_blocks(r.request_id) for r in sched.running) * bs
            used += kv.pool.num_held_blocks * bs if kv.pool.hard_holds else 0  # reserved, so not free
            res.frag.append(1 - live / used if used else 0.0)
            res.held.append(kv.pool.num_held_blocks)
            if res.steps % 25 == 0:
                res.contiguity.append(contiguity([kv.block_ids(r.request_id) for r in sched.running]))
        if not batch.requests and sched.waiting:
            raise RuntimeError(f"{name}: nothing scheduled with {len(sched.waiting)} waiting (budget too small)")
    kv.check_integrity()
    res.preemptions = sched.num_preemptions
    res.recomputed_tokens = sum(r.num_forwarded_tokens - (r.num_tokens - 1) for r in reqs)
    res.prefix_hit_tokens = kv.prefix_stats().num_hit_tokens
    res.paging = vars(kv.pager.stats())
    return res


def flush(buf: torch.Tensor) -> None:
    buf.add_(1.0)  # touches more memory than the last-level cache holds


def time_attention(snap: Snapshot, k: torch.Tensor, v: torch.Tensor, buf: torch.Tensor, reps: int,
                   contiguous: bool) -> float:
    """Median seconds of one layer's decode attention over the snapshot's rows (tables as they are,
    or the same lengths laid out contiguously)."""
    tables = snap.tables
    if contiguous:
        tables, start = [], 0
        for t in snap.tables:
            tables.append(list(range(start, start + len(t))))
            start += len(t)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(snap.seq_lens, dtype=torch.int32)
    q = torch.randn(len(tables), NUM_HEADS, HEAD_DIM)
    times = []
    for _ in range(reps):
        flush(buf)
        t0 = time.perf_counter()
        out = paged_decode_attention_native(q, k, v, bt, lens, HEAD_DIM ** -0.5)
        times.append(time.perf_counter() - t0)
        assert out is not None
    return float(np.median(times))


def attention_figures(results: list[SimResult], num_blocks: int, block_size: int, reps: int) -> dict[str, Any]:
    if library() is None:
        progress("native CPU kernel unavailable: no attention timing")
        return {}
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, generator=g)
    buf = torch.zeros(48 << 20 >> 2)
    out = {}
    for res in results:
        as_is = ideal = 0.0
        tokens = 0
        for snap in res.snapshots:
            if not snap.tables:
                continue
            as_is += time_attention(snap, k, v, buf, reps, contiguous=False)
            ideal += time_attention(snap, k, v, buf, reps, contiguous=True)
            tokens += sum(snap.seq_lens)
        if tokens:
            out[res.name] = {"rows": sum(len(s.tables) for s in res.snapshots), "context_tokens": tokens,
                             "ms_per_1k_tokens": as_is * 1e6 / tokens, "contiguous_ms_per_1k_tokens": ideal * 1e6 / tokens,
                             "table_contiguity": contiguity([t for s in res.snapshots for t in s.tables])}
    return out


def figures(results: list[SimResult], attention: dict[str, Any], args: argparse.Namespace,
            trace: list[TraceRequest]) -> dict[str, Any]:
    base = results[0]
    base_conc = float(np.mean(base.running))
    base_frag = float(np.mean(base.frag))
    rows = []
    for res in results:
        conc = float(np.mean(res.running)) if res.running else 0.0
        att = attention.get(res.name, {})
        rows.append({
            "policy": res.name, "admitted_concurrency": conc, "vs_lazy": conc / base_conc,
            "saturated_steps": res.saturated_steps, "steps": res.steps,
            "output_tokens_per_step": res.output_tokens / res.steps,
            "preemptions": res.preemptions, "recomputed_tokens": res.recomputed_tokens,
            "internal_frag": float(np.mean(res.frag)) if res.frag else 0.0,
            "held_blocks_mean": float(np.mean(res.held)) if res.held else 0.0,
            "contiguity": float(np.mean(res.contiguity)) if res.contiguity else 1.0,
            "attn_ms_per_1k_tokens": att.get("ms_per_1k_tokens"),
            "attn_contiguous_ms_per_1k_tokens": att.get("contiguous_ms_per_1k_tokens"),
            "attn_vs_lazy": (att["ms_per_1k_tokens"] / attention[base.name]["ms_per_1k_tokens"]
                             if att and base.name in attention else None),
            "prefix_hit_tokens": res.prefix_hit_tokens, "paging": res.paging,
        })
    prompts = np.array([t.prompt_len for t in trace])
    outputs = np.array([t.output_len for t in trace])
    return {
        "trace": "azure_llm_2023_conv.csv", "requests": len(trace),
        "prompt_tokens": {"mean": float(prompts.mean()), "p50": float(np.median(prompts)), "max": int(prompts.max())},
        "output_tokens": {"mean": float(outputs.mean()), "p50": float(np.median(outputs)), "max": int(outputs.max())},
        "kv_tokens": args.kv_tokens, "block_size": args.block_size, "max_seqs": args.max_seqs,
        "step_tokens": args.step_tokens, "prefix_caching": not args.no_prefix_caching, "long_tokens": args.long_tokens, "run_blocks": args.run_blocks,
        "snapshot_steps": args.snapshot_steps,
        "bound_vs_lazy": 1 / (1 - base_frag) if base_frag < 1 else None,
        "policies": rows,
    }


def render(f: dict[str, Any]) -> str:
    title = (f"{f['trace']}: first {f['requests']} requests, prompt mean {f['prompt_tokens']['mean']:.0f} "
             f"(p50 {f['prompt_tokens']['p50']:.0f}), output mean {f['output_tokens']['mean']:.0f} "
             f"(p50 {f['output_tokens']['p50']:.0f}) tokens, unscaled; KV budget {f['kv_tokens']:,} tokens "
             f"(blocks of {f['block_size']}), long >= {f['long_tokens']} tokens expected, runs hold "
             f"{f['run_blocks']} blocks ahead")
    headers = ["policy", "concurrency", "vs lazy", "out tok/step", "preempt", "recomputed", "frag %", "held",
               "contig %", "attn ms/1k tok", "attn vs lazy", "contig. layout"]
    rows = [[r["policy"], r["admitted_concurrency"], r["vs_lazy"], r["output_tokens_per_step"], r["preemptions"],
             r["recomputed_tokens"], 100 * r["internal_frag"], r["held_blocks_mean"], 100 * r["contiguity"],
             r["attn_ms_per_1k_tokens"], r["attn_vs_lazy"], r["attn_contiguous_ms_per_1k_tokens"]]
            for r in f["policies"]]
    bound = f["bound_vs_lazy"]
    note = (f"\nbound: no placement policy can admit more than {bound:.4f}x lazy's concurrency at this budget "
            f"(lazy's blocks hold KV but for its {100 * (1 - 1 / bound):.2f}% internal fragmentation)")
    return format_table(headers, rows, title) + note


def bench(args: argparse.Namespace) -> dict[str, Any]:
    trace = load_azure_conv(limit=args.requests)
    chosen = policies(args.long_tokens, args.run_blocks)
    results = []
    for name in args.policies.split(","):
        progress(f"simulating {name}")
        t0 = time.perf_counter()
        results.append(simulate(name, chosen[name], make_requests(trace, args.block_size), args))
        progress(f"{name}: {results[-1].steps} steps in {time.perf_counter() - t0:.1f} s")
    progress("timing decode attention")
    attention = attention_figures(results, args.kv_tokens // args.block_size, args.block_size, args.reps)
    return figures(results, attention, args, trace)


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--kv-tokens", type=int, default=131072)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-seqs", type=int, default=1024)
    p.add_argument("--step-tokens", type=int, default=2048)
    p.add_argument("--long-tokens", type=int, default=1024)
    p.add_argument("--run-blocks", type=int, default=32)
    p.add_argument("--snapshot-steps", type=int, nargs="+", default=[300, 600, 900])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--policies", default="lazy,aware-soft,aware-hard,reserve-max")
    p.add_argument("--no-prefix-caching", action="store_true", help="freed blocks keep no prefix (all empty)")
    args = p.parse_args()
    if not args.policies.startswith("lazy"):
        p.error("the first policy must be lazy: the others are reported against it")
    run(bench, args, render)


if __name__ == "__main__":
    main()
