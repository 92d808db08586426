"""Speculative decoding on real prompts: decode tokens/s, TPOT and acceptance, with and without it.

The workloads (bench/spec_workloads.py) are chat prompts built from files on this machine: code
editing (a site-packages module + "rename a function, output the whole file": n-gram drafts should
pay), summarization (README/docs sections) and open chat (nothing to copy: speculation should not
pay). One engine per method (`off` and each of `--methods`) is loaded up front; for each workload
and batch size B (`--batches`) every engine runs the same prompts, one after the other, so load
from other users of a shared box hits them alike. At batch B the engine takes max(B,
`--min-requests`) prompts (rounded up to whole waves of B), a wave of B at a time, greedy, up to
`--max-tokens` output tokens each, stopping at EOS. The engines take turns `--repeats` times per
cell (2; which goes first rotates, so no method always runs first) and the figures pool the passes.
- decode tokens/s: tokens emitted once every request of the wave has its first token, divided by
  the time from then to the wave's end (bench/engine.py's window: prefill stays out of it), summed
  over waves;
- TPOT per request: (time of its last token - time of its first) / (output tokens - 1); mean and P99;
- acceptance: accepted / drafted tokens (RequestOutput's running totals at the end of each request);
  spec steps: the engine's steps that verified drafts (EngineStats.num_spec_steps);
- mismatches: requests whose greedy tokens differ from the `off` engine's at the same B, with the
  first differing position and the `off` engine's top-2 logprob gap there (rerun alone): ~0 is a
  near tie flipped by rounding (bf16), a large gap a bug.
`speedup_bB` = decode tokens/s with the method / without, same run. Targets of issue 23 are
printed beside the figures; nothing is asserted. Exit status 1 when any greedy output differs.

    python -m bench.spec [--model smollm2|random-smollm2|PATH] [--device auto|cpu|cuda] [--dtype auto]
        [--batches 1,4,16] [--methods ngram,early_exit] [--workloads code_edit,summarize,chat]
        [--max-tokens 128] [--max-source-tokens 1300] [--max-draft-tokens 4] [--policy auto]
        [--exit-layer L] [--min-requests 2] [--repeats 2] [--threads N] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.sampling import SamplingParams
from actors.engine.spec import SpecConfig
from bench.common import bench_parser, csv, format_table, peak_rss_bytes, progress, run
from bench.engine import MODEL, bench_device, load_model
from bench.engine_runners import CPU_KV_CACHE_BYTES, synchronize
from bench.sim.metrics import percentile
from bench.spec_workloads import WORKLOADS, Prompt, TokenText, Workload, build_workloads

OFF = "off"
MAX_MODEL_LEN = 2048  # the longest prompt (~1,350 tokens) + output fits
BATCH_TOKENS = 2048  # per-step token budget: a few long prompts prefill per step
WARMUP_TOKENS = 8
QUICK = {"max_tokens": 16, "max_source_tokens": 96, "min_requests": 1, "repeats": 1}  # --quick: the test's size
# Issue 23's targets: (method, workload, batch, minimum speedup)
TARGETS = (("ngram", "code_edit", 1, 1.5), ("ngram", "code_edit", 16, 0.95))


@dataclass(frozen=True)
class Finished:
    """One request's outcome: its tokens, when its first and last came, its draft totals."""

    token_ids: tuple[int, ...]
    first_s: float
    last_s: float
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_ids)
        return (self.last_s - self.first_s) / (n - 1) if n > 1 else None


def make_engine(model: Path, method: str, args: argparse.Namespace) -> Engine:
    cfg = EngineConfig(dtype=args.dtype, device=str(args.torch_device), max_num_seqs=max(args.batches),
                       max_num_batched_tokens=BATCH_TOKENS, kv_cache_bytes=CPU_KV_CACHE_BYTES,
                       max_model_len=MAX_MODEL_LEN,
                       speculation=SpecConfig(method=method, max_draft_tokens=args.max_draft_tokens,
                                              policy=args.policy, exit_layer=args.exit_layer))
    return Engine.from_pretrained(model, cfg)


def run_wave(engine: Engine, prompts: Sequence[Prompt], max_tokens: int, tag: str) -> tuple[list[Finished], int, float]:
    """Runs the prompts together to completion: (their outcomes in order, tokens in the decode
    window, its seconds). The window opens when every request has its first token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, list(p.token_ids), params)
    first: dict[str, float] = {}
    done: dict[str, Finished] = {}
    t0: float | None = None
    now = 0.0
    window_tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        synchronize(engine.device)
        now = time.perf_counter()
        for o in outputs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                if t0 is not None:
                    window_tokens += len(o.new_token_ids)
            if o.finished:
                done[o.request_id] = Finished(o.token_ids, first.get(o.request_id, now), now,
                                              o.num_draft_tokens, o.num_accepted_tokens)
        if t0 is None and len(first) == len(ids):
            t0 = now
    window_s = now - t0 if t0 is not None and window_tokens else 0.0
    return [done[rid] for rid in ids], window_tokens, window_s


@dataclass(frozen=True)
class CellRun:
    """One engine's pass over a cell's prompts."""

    finished: list[Finished]
    window_tokens: int
    window_s: float
    spec_steps: int


def run_cell(engine: Engine, prompts: Sequence[Prompt], batch: int, max_tokens: int, tag: str) -> CellRun:
    """The prompts in waves of `batch`."""
    spec_steps_before = engine.stats().num_spec_steps
    finished: list[Finished] = []
    tokens, seconds = 0, 0.0
    for w in range(0, len(prompts), batch):
        done, n, s = run_wave(engine, prompts[w:w + batch], max_tokens, f"{tag}-w{w // batch}")
        finished += done
        tokens += n
        seconds += s
    return CellRun(finished, tokens, seconds, engine.stats().num_spec_steps - spec_steps_before)


def cell_figures(runs: Sequence[CellRun]) -> dict[str, Any]:
    """A cell's figures over its repeats: window tokens and seconds summed, TPOTs pooled."""
    finished = [f for r in runs for f in r.finished]
    tokens, seconds = sum(r.window_tokens for r in runs), sum(r.window_s for r in runs)
    tpots = [f.tpot_s for f in finished if f.tpot_s is not None]
    drafted = sum(f.num_draft_tokens for f in finished)
    accepted = sum(f.num_accepted_tokens for f in finished)
    p99 = percentile(tpots, 99)
    return {
        "requests": len(runs[0].finished),
        "decode_tok_s": tokens / seconds if seconds > 0 else None,
        "window_tokens": tokens,
        "window_s": seconds,
        "tpot_mean_ms": 1e3 * sum(tpots) / len(tpots) if tpots else None,
        "tpot_p99_ms": 1e3 * p99 if p99 is not None else None,
        "output_tokens_mean": sum(len(f.token_ids) for f in finished) / len(finished),
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None,
        "spec_steps": sum(r.spec_steps for r in runs),
    }


def mismatches(got: list[Finished], want: list[Finished], prompts: Sequence[Prompt]) -> list[dict[str, Any]]:
    """Each request whose tokens differ from the baseline's: which prompt, and the first differing position."""
    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g.token_ids != w.token_ids:
            at = next((j for j, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b),
                      min(len(g.token_ids), len(w.token_ids)))
            out.append({"prompt": i, "source": prompts[i].source, "position": at,
                        "tokens": len(g.token_ids), "baseline_tokens": len(w.token_ids)})
    return out


def baseline_margin(engine: Engine, prompt: Prompt, position: int, tag: str) -> float | None:
    """Logprob gap between the two likeliest tokens at `position` of the prompt's greedy output, run
    alone again on the engine without speculation. About 0: a near tie, which a rounding difference
    can flip (bf16 forwards of other shapes, such as a verification's, round differently); large: a bug."""
    params = SamplingParams(max_tokens=position + 1, temperature=0.0, logprobs=2)
    engine.add_request(tag, list(prompt.token_ids), params)
    logprobs = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            logprobs += o.logprobs
    lp = logprobs[position] if position < len(logprobs) else None
    if lp is None or len(lp.top) < 2:
        return None
    first, second = sorted((v for _, v in lp.top), reverse=True)[:2]
    return first - second


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _lengths(values: Sequence[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def num_requests(batch: int, min_requests: int) -> int:
    """Whole waves of `batch`, at least `min_requests` requests."""
    return -(-max(batch, min_requests) // batch) * batch


def bench_workload(wl: Workload, engines: dict[str, Engine], args: argparse.Namespace) -> dict[str, Any]:
    off: dict[str, Any] = {}
    methods: dict[str, dict[str, Any]] = {m: {"batches": {}} for m in args.methods}
    outputs: list[int] = []
    for b in args.batches:
        prompts = wl.prompts[:num_requests(b, args.min_requests)]
        runs: dict[str, list[CellRun]] = {m: [] for m in [OFF, *args.methods]}
        found: dict[str, list[dict[str, Any]]] = {m: [] for m in args.methods}
        order = list(runs)
        for r in range(args.repeats):  # engines take turns, so that a burst of load hits one repeat of each
            progress(f"{wl.name} B={b}: {len(prompts)} requests, repeat {r + 1}/{args.repeats} "
                     f"({time.perf_counter() - args.t_start:.0f} s)")
            for m in order[r % len(order):] + order[:r % len(order)]:  # who goes first rotates per repeat
                runs[m].append(run_cell(engines[m], prompts, b, args.max_tokens, f"{wl.name}-{m}-b{b}-r{r}"))
            for m in args.methods:
                for x in mismatches(runs[m][-1].finished, runs[OFF][-1].finished, prompts):
                    tag = f"{wl.name}-{m}-b{b}-r{r}-margin-{x['prompt']}"
                    found[m].append({**x, "repeat": r, "baseline_top2_margin": baseline_margin(
                        engines[OFF], prompts[x["prompt"]], x["position"], tag)})
        off[f"b{b}"] = cell_figures(runs[OFF])
        outputs += [len(f.token_ids) for f in runs[OFF][0].finished]
        for m in args.methods:
            cell = cell_figures(runs[m])
            cell["speedup"] = _ratio(cell["decode_tok_s"], off[f"b{b}"]["decode_tok_s"])
            cell["mismatch_list"] = found[m]
            cell["mismatches"] = len(found[m])
            if found[m]:
                progress(f"MISMATCH: {wl.name} B={b} {m}: {len(found[m])} greedy outputs differ from {OFF}'s: "
                         f"{found[m]}")
            methods[m]["batches"][f"b{b}"] = cell
    for m, fig in methods.items():
        cells = fig["batches"].values()
        for b in args.batches:
            fig[f"speedup_b{b}"] = fig["batches"][f"b{b}"]["speedup"]
        drafted = sum(c["draft_tokens"] for c in cells)
        fig["acceptance"] = sum(c["accepted_tokens"] for c in cells) / drafted if drafted else None
        fig["draft_tokens"] = drafted
        fig["mismatches"] = sum(c["mismatches"] for c in cells)
    n = num_requests(max(args.batches), args.min_requests)
    return {
        "description": wl.description,
        "sources": [{"name": s.name, "tokens": s.num_tokens, "tokens_before_clip": s.num_tokens_full}
                    for s in wl.sources],
        "num_prompts": n,
        "prompt_tokens": _lengths([len(p.token_ids) for p in wl.prompts[:n]]),
        "output_tokens": _lengths(outputs),
        OFF: off,
        "methods": methods,
    }


def targets(workloads: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for method, wl, b, least in TARGETS:
        value = workloads.get(wl, {}).get("methods", {}).get(method, {}).get(f"speedup_b{b}")
        if value is not None:
            out.append({"name": f"{method} {wl} speedup_b{b}", "min": least, "value": value, "met": value >= least})
    return out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ferry-bench-spec-") as tmp:
        model, args.model_label = load_model(args.model, tmp)
        figures = bench_model(args, model)
    figures["peak_rss_bytes"] = peak_rss_bytes()
    return figures


def bench_model(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    engines: dict[str, Engine] = {}
    for method in [OFF, *args.methods]:
        progress(f"loading an engine with speculation {method} on {args.torch_device}")
        engines[method] = make_engine(model, method, args)
    eng = engines[OFF]
    tok = TokenText(lambda t: eng.tokenizer.encode(t, add_special_tokens=False), eng.tokenizer.decode,
                    eng.encode_chat)
    count = num_requests(max(args.batches), args.min_requests)
    workloads = build_workloads(tok, args.workloads, count, args.max_source_tokens)
    for method, engine in engines.items():  # first-call costs (and the sources' prefill) out of the figures
        progress(f"warm-up {method}")
        run_wave(engine, [w.prompts[0] for w in workloads], WARMUP_TOKENS, f"warmup-{method}")
    figures: dict[str, Any] = {
        "model": args.model, "model_label": args.model_label, "device": str(args.torch_device),
        "dtype": eng.cfg.dtype, "torch_threads": torch.get_num_threads(),
        "config": {"batches": args.batches, "methods": args.methods, "max_tokens": args.max_tokens,
                   "max_source_tokens": args.max_source_tokens, "max_draft_tokens": args.max_draft_tokens,
                   "policy": args.policy, "exit_layer": args.exit_layer, "min_requests": args.min_requests,
                   "repeats": args.repeats, "quick": args.quick},
        "workloads": {w.name: bench_workload(w, engines, args) for w in workloads},
    }
    figures["mismatches"] = sum(m["mismatches"] for w in figures["workloads"].values() for m in w["methods"].values())
    figures["greedy_identical"] = figures["mismatches"] == 0
    figures["targets"] = targets(figures["workloads"])
    stats = {m: e.stats() for m, e in engines.items()}  # totals since load, warm-up included
    figures["engine_stats"] = {m: {"spec_method": st.spec_method, "spec_steps": st.num_spec_steps,
                                   "draft_tokens": st.num_draft_tokens, "accepted_tokens": st.num_accepted_tokens}
                               for m, st in stats.items()}
    return figures


def _fmt_lengths(d: dict[str, float]) -> str:
    return f"{d['mean']:.0f} ({d['min']:.0f}-{d['max']:.0f})"


def render(figures: dict[str, Any]) -> str:
    wls = figures["workloads"]
    rows = [[name, w["num_prompts"], _fmt_lengths(w["prompt_tokens"]), _fmt_lengths(w["output_tokens"]),
             ", ".join(f"{s['name']} ({s['tokens']})" for s in w["sources"]) or "-"] for name, w in wls.items()]
    parts = [format_table(["workload", "prompts", "prompt tokens", "output tokens", "sources (tokens)"], rows,
                          title="Workloads (token counts: mean (min-max); sources as the model sees them)")]
    rows = []
    for name, w in wls.items():
        for b in figures["config"]["batches"]:
            base = w[OFF][f"b{b}"]
            rows.append([name, b, OFF, base["decode_tok_s"], None, base["tpot_mean_ms"], base["tpot_p99_ms"],
                         None, None, None])
            for m, fig in w["methods"].items():
                c = fig["batches"][f"b{b}"]
                rows.append([name, b, m, c["decode_tok_s"], f"{c['speedup']:.2f}x" if c["speedup"] else None,
                             c["tpot_mean_ms"], c["tpot_p99_ms"],
                             f"{100 * c['acceptance']:.0f}%" if c["acceptance"] is not None else None,
                             f"{c['accepted_tokens']}/{c['draft_tokens']} in {c['spec_steps']}",
                             c["mismatches"]])
    parts.append(format_table(
        ["workload", "B", "method", "decode tok/s", "speedup", "TPOT mean ms", "TPOT P99 ms", "accepted",
         "accepted/drafted in steps", "mismatches"], rows,
        title=f"Decode with and without speculation, {figures['model_label']} on {figures['device']}, "
              f"{figures['dtype']} (greedy; speedup: tok/s vs {OFF}, same run)"))
    lines = [f"target {t['name']} >= {t['min']:.2f}x: {t['value']:.2f}x, {'met' if t['met'] else 'NOT met'}"
             for t in figures["targets"]]
    for name, w in wls.items():
        for m, fig in w["methods"].items():
            for b, cell in fig["batches"].items():
                for x in cell["mismatch_list"]:
                    gap = x["baseline_top2_margin"]
                    lines.append(f"mismatch: {name} {b} {m}, prompt {x['prompt']} {x['source'] or ''}".rstrip()
                                 + f", from output token {x['position']}; off's top-2 logprob gap there "
                                 + ("unknown" if gap is None else f"{gap:.3f}"))
    lines.append("greedy outputs identical to off: " + (
        "yes" if figures["greedy_identical"] else f"NO, {figures['mismatches']} requests differ (see --json)"))
    c = figures["config"]
    lines.append(f"torch threads {figures['torch_threads']}, up to {c['max_tokens']} output tokens, sources clipped "
                 f"at {c['max_source_tokens']} tokens, k <= {c['max_draft_tokens']}, policy {c['policy']}; peak RSS "
                 f"{figures['peak_rss_bytes'] / 2**20:,.0f} MiB; wall {figures['wall_s']:.0f} s")
    parts.append("\n".join(lines))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, model=MODEL, device="auto", dtype="auto", threads=os.cpu_count() or 1)
    p.add_argument("--batches", type=csv(int), default=[1, 4, 16])
    p.add_argument("--methods", type=csv(str), default=["ngram", "early_exit"])
    p.add_argument("--workloads", type=csv(str), default=list(WORKLOADS))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-source-tokens", type=int, default=1300, help="clip each source text to this many tokens")
    p.add_argument("--max-draft-tokens", type=int, default=4)
    p.add_argument("--exit-layer", type=int, default=None, help="early_exit: layers of the draft (default half)")
    p.add_argument("--policy", choices=["auto", "always"], default="auto",
                   help="auto: the engine drafts where its step-time model says it pays; always: every row drafts")
    p.add_argument("--min-requests", type=int, default=2, help="at least this many requests per batch size")
    p.add_argument("--repeats", type=int, default=2,
                   help="passes of every engine over each cell, taking turns (the first to go rotates)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK['max_tokens']} output tokens, sources of {QUICK['max_source_tokens']} "
                        f"tokens, {QUICK['min_requests']} request per batch size at least, one pass (unless given)")
    if p.parse_args(argv).quick:  # its sizes become the defaults: flags given still win
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    if OFF in args.methods or not args.methods or min(args.batches, default=0) < 1 or args.max_tokens < 2 \
            or args.repeats < 1:
        p.error(f"--methods: speculation methods besides {OFF}; --batches and --repeats positive; --max-tokens >= 2")
    args.torch_device = bench_device(args.device)
    args.t_start = time.perf_counter()
    figures = run(bench, args, render)
    return 0 if figures["greedy_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
