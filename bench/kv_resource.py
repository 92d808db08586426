"""KV as a managed resource inside one engine, at real lengths: tenant shares and batch offload.

Two scenarios on the real model (SmolLM2-135M, this machine's dtype), each run in the same process
with and without the mechanism, requests arriving on a wall-clock schedule while the engine steps:

- shares: a quiet tenant sends a chat request every 4 s that shares a 768-token system prompt
  (plus 128 tokens of its own); a flooding tenant sends a unique 1,024-token prompt every 2 s. The
  engine's KV pool (128 blocks) holds two prompts, so under plain LRU the two flood prompts between
  quiet requests evict the quiet tenant's cached prompt. Reported: the quiet tenant's prefix-hit rate and TTFT (p50, p99)
  alone, flooded with one shared pool, and flooded with a guaranteed share for it.
- offload: two batch-class requests (1,024-token prompts, 160 output tokens) fill the pool; then
  interactive requests (512-token prompts) arrive. Without offload they wait for a batch request to
  finish; with it the batch KV goes to host memory and comes back. Reported: interactive TTFT,
  batch completion, tokens forwarded beyond one pass, and whether the batch outputs are identical.

Prompts are real text: this repository's docs and source files, tokenized. Run:
    python bench/kv_resource.py [--json] [--scenarios shares,offload]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.engine.config import EngineConfig  # noqa: E402
from actors.engine.engine import Engine  # noqa: E402
from actors.engine.options import RequestOptions  # noqa: E402
from actors.engine.sampling import SamplingParams  # noqa: E402
from actors.engine.shares import TenantShare, TenantShares  # noqa: E402
from bench.common import bench_parser, format_table, progress, run  # noqa: E402
from bench.sim.metrics import percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Arrival:
    at_s: float
    request_id: str
    tokens: list[int]
    max_tokens: int
    options: RequestOptions


@dataclass
class Outcome:
    arrival_s: float
    first_token_s: float | None = None
    done_s: float | None = None
    num_prompt: int = 0
    num_cached: int = 0
    token_ids: tuple[int, ...] = ()

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s


def corpus_tokens(engine: Engine) -> list[int]:
    """This repository's docs and Python sources, tokenized once, in a fixed order."""
    files = [ROOT / "docs" / "architecture.md", ROOT / "README.md"] + sorted(ROOT.glob("actors/**/*.py"))
    return engine.tokenizer.encode("\n".join(f.read_text() for f in files), add_special_tokens=False)


def warmed(cfg: EngineConfig, text: list[int]) -> Engine:
    """An engine that has run a full-budget prompt and a decode once (the first steps of a fresh
    process pay for kernel set-up), with nothing left in its prefix cache."""
    engine = Engine.from_pretrained("smollm2", cfg)
    engine.generate([text[-1500:]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.kv.pool.reset_prefix_cache()
    return engine


def drive(engine: Engine, arrivals: list[Arrival]) -> dict[str, Outcome]:
    """Adds each request at its time while stepping the engine; what each request saw."""
    pending = sorted(arrivals, key=lambda a: a.at_s)
    seen: dict[str, Outcome] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].at_s <= now:
            a = pending.pop(0)
            engine.add_request(a.request_id, a.tokens, SamplingParams(max_tokens=a.max_tokens, temperature=0,
                                                                      ignore_eos=True), a.options)
            seen[a.request_id] = Outcome(arrival_s=a.at_s, num_prompt=len(a.tokens))
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0].at_s - now)))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            o = seen[out.request_id]
            if o.first_token_s is None and out.new_token_ids:
                o.first_token_s, o.num_cached = now, out.num_cached_tokens
            if out.finished:
                o.done_s, o.token_ids = now, tuple(out.token_ids)
    return seen


def shares_scenario(base: EngineConfig, text: list[int], num_quiet: int, flood_per_quiet: int) -> list[dict[str, Any]]:
    system = text[:768]
    # A quiet request every 4 s, a flood prompt every 4 / flood_per_quiet s: two flood prompts
    # between quiet requests fill the pool with newer blocks than the quiet tenant's prompt.
    quiet = [Arrival(1.0 + 4.0 * i, f"q{i}", system + text[4000 + 128 * i: 4128 + 128 * i], 4,
                     RequestOptions(tenant="quiet")) for i in range(num_quiet)]
    flood = [Arrival(0.5 + 4.0 * i / flood_per_quiet, f"f{i}", text[20000 + 1024 * i: 21024 + 1024 * i], 4,
                     RequestOptions(tenant="flood")) for i in range(num_quiet * flood_per_quiet)]
    guarded = TenantShares.of_mapping({"quiet": TenantShare(guaranteed=0.45)})
    runs = [("quiet alone", quiet, TenantShares()), ("flooded, one shared pool", quiet + flood, TenantShares()),
            ("flooded, quiet guaranteed 45%", quiet + flood, guarded)]
    rows = []
    for name, arrivals, shares in runs:
        progress(f"shares: {name} ({len(arrivals)} requests)")
        engine = warmed(replace(base, tenant_kv_shares=shares), text)
        warm_evictions = engine.stats().num_evictions
        seen = drive(engine, arrivals)
        q = [seen[a.request_id] for a in quiet][1:]  # the first one has nothing cached yet anywhere
        ttft = [o.ttft_s for o in q]
        rows.append({"run": name, "quiet_hit_rate": sum(o.num_cached for o in q) / sum(o.num_prompt for o in q),
                     "quiet_ttft_p50_s": statistics.median(ttft), "quiet_ttft_p99_s": percentile(ttft, 99),
                     "evictions": engine.stats().num_evictions - warm_evictions, "num_blocks": engine.num_blocks})
    return rows


def offload_scenario(base: EngineConfig, text: list[int], num_chat: int) -> list[dict[str, Any]]:
    batch = [Arrival(0.0, f"b{i}", text[30000 + 1024 * i: 31024 + 1024 * i], 160,
                     RequestOptions(priority_rank=1, tenant="batch")) for i in range(2)]
    chats = [Arrival(4.0 + 2.5 * i, f"c{i}", text[40000 + 512 * i: 40512 + 512 * i], 16,
                     RequestOptions(tenant="chat")) for i in range(num_chat)]
    ideal = sum(len(a.tokens) + a.max_tokens - 1 for a in batch + chats)  # every token forwarded once
    rows, outputs = [], {}
    for name, offload_bytes in (("recompute (no offload)", 0), ("offload to host", base.max_offload_bytes)):
        progress(f"offload: {name}")
        engine = warmed(replace(base, max_offload_bytes=offload_bytes), text)
        warm_forwarded = engine.stats().num_forwarded_tokens
        seen = drive(engine, batch + chats)
        ttft = [seen[a.request_id].ttft_s for a in chats]
        outputs[name] = {a.request_id: seen[a.request_id].token_ids for a in batch}
        stats = engine.stats()
        rows.append({"run": name, "chat_ttft_p50_s": statistics.median(ttft), "chat_ttft_max_s": max(ttft),
                     "batch_done_s": max(seen[a.request_id].done_s or 0.0 for a in batch),
                     "extra_forwarded_tokens": stats.num_forwarded_tokens - warm_forwarded - ideal, "offloads": stats.num_offloads,
                     "preemptions": stats.num_preemptions, "num_blocks": engine.num_blocks})
    same = len(set(map(lambda o: tuple(sorted(o.items())), outputs.values()))) == 1
    for row in rows:
        row["batch_outputs_identical"] = same
    return rows


def render(figures: dict[str, Any]) -> str:
    out = []
    if "shares" in figures:
        out.append(format_table(
            ["run", "quiet hit rate", "quiet TTFT p50 s", "quiet TTFT p99 s", "evictions"],
            [[r["run"], round(r["quiet_hit_rate"], 3), round(r["quiet_ttft_p50_s"], 3), round(r["quiet_ttft_p99_s"], 3),
              r["evictions"]] for r in figures["shares"]],
            title=f"Tenant shares: quiet tenant 768-token shared prompt + 128 own, flood 1,024-token unique prompts; "
                  f"{figures['shares'][0]['num_blocks']} KV blocks of 16"))
    if "offload" in figures:
        out.append(format_table(
            ["run", "chat TTFT p50 s", "chat TTFT max s", "batch done s", "extra forwarded", "offloads",
             "preemptions", "batch identical"],
            [[r["run"], round(r["chat_ttft_p50_s"], 3), round(r["chat_ttft_max_s"], 3), round(r["batch_done_s"], 2),
              r["extra_forwarded_tokens"], r["offloads"], r["preemptions"], r["batch_outputs_identical"]]
             for r in figures["offload"]],
            title=f"Batch offload: 2 batch requests (1,024-token prompts, 160 out) then 512-token chats (16 out); "
                  f"{figures['offload'][0]['num_blocks']} KV blocks of 16"))
    return "\n\n".join(out)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    scenarios = args.scenarios.split(",")
    figures: dict[str, Any] = {}
    # Pools sized to hold a few real-length prompts, as a busy GPU's pool does for its batch.
    if "shares" in scenarios:
        cfg = EngineConfig(dtype=args.dtype, num_blocks=128)
        text = corpus_tokens(Engine.from_pretrained("smollm2", replace(cfg, num_blocks=16)))
        figures["shares"] = shares_scenario(cfg, text, args.num_quiet, args.flood_per_quiet)
    if "offload" in scenarios:
        cfg = EngineConfig(dtype=args.dtype, num_blocks=160)
        text = corpus_tokens(Engine.from_pretrained("smollm2", replace(cfg, num_blocks=16)))
        figures["offload"] = offload_scenario(cfg, text, args.num_chat)
    return figures


def main() -> None:
    p = bench_parser(__doc__, dtype="auto")
    p.add_argument("--scenarios", default="shares,offload")
    p.add_argument("--num-quiet", type=int, default=6)
    p.add_argument("--flood-per-quiet", type=int, default=2, help="flood prompts per quiet request")
    p.add_argument("--num-chat", type=int, default=3)
    run(bench, p.parse_args(), render)


if __name__ == "__main__":
    main()
