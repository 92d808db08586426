"""A decode worker killed with streams in flight, on SmolLM2-135M: do the streams finish, and how long do they stall?

Each scenario is a fresh deployment on one local Ray cluster, placed by the scheduler actor as
`ferry serve` does: the same `--streams` greedy chat requests are first run twice without a failure
(the reference: tokens, and the longest gap between two tokens of a stream when nothing fails; the
second run says how many streams two failure-free runs agree on), then again with the decode worker
that holds most of them killed (`ray.kill`, like a SIGKILL) as soon as every stream has
`--kill-after` tokens. Each run is its own tenant, so no run reuses another's cached prompt blocks,
and streams start one after another (the next once the previous has its first token), so every
prompt is prefilled alone and the same way in every run.
- `1P+1D replace`: the lone decode worker dies; the streams resume on the prefill worker, lent
  until a replacement of the same name is up (what `ferry serve` runs: `replace_dead_workers` and
  `lend_prefill` on).
- `1P+1D no-replace`: the same deployment without replacement: the lent prefill worker is the only
  place the streams can resume.
- `1P+2D replace`: a second decode worker survives and takes the streams over at once; the dead one
  is replaced in the background.
Each scenario runs with both `--kv-recovery` modes (default): `shadow`, the streams' KV blocks are
copied to the prefix-cache pool as they fill and the resume imports them (only the last partial
block is computed again, one token a step), and `recompute`, the resume recomputes prompt + streamed
tokens. Both deployments have the same one-store pool. With `shadow` the kill waits, after
`--kill-after` tokens, until the victim's shadows of its streams' prompts are in the pool (no offer
on its way): a kill before that recomputes, which is what `recompute` measures.
Per scenario: streams that finished, each finished stream's stall (its longest gap between two
tokens, which spans the failure) against the failure-free run's, the time from the kill to the
replacement answering, the streams whose tokens equal the failure-free run's (with `recompute`, in
bfloat16 the recomputed prefix rounds differently from the decode steps that made it, so a greedy
stream may take another path after the resume point), and the shadow blocks the resumes imported.

    .venv/bin/python bench/recovery.py [--streams 6] [--max-tokens 96] [--kill-after 24] [--dtype bfloat16]
        [--model smollm2] [--scenarios all] [--kv-recovery shadow,recompute] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

if __name__ == "__main__":
    _here = Path(__file__).resolve().parent  # import from the repository root, not bench/
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every Ray port on 127.0.0.1

import ray

from actors.engine.config import EngineConfig
from actors.engine.fetch import resolve_model
from actors.engine.sampling import SamplingParams
from actors.engine.tokenizer import Tokenizer
from actors.messages import GenerationRequest, RequestPolicy
from actors.prefix_cache.store import PrefixCacheConfig
from actors.worker_config import MIB
from actors.worker_config import WorkerConfig
from bench.common import format_table, progress, run_on_local_ray
from bench.pd import QUESTIONS, chat
from cluster.router.client import Router
from cluster.router.config import RecoveryConfig, RouterConfig
from cluster.router.ray_handles import router_for

MODEL = "smollm2"
CLIENT = RouterConfig(call_timeout_s=60, prefill_timeout_s=120, token_timeout_s=120, load_ttl_s=0.1)
SCENARIOS = (("1P+1D replace", 1, True), ("1P+1D no-replace", 1, False), ("1P+2D replace", 2, True))
KV_RECOVERY = ("shadow", "recompute")


@dataclasses.dataclass
class Run:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    arrivals: list[float] = dataclasses.field(default_factory=list)  # perf_counter at the caller, per token
    error: str | None = None
    at_kill: int | None = None  # tokens it had received when the kill came

    @property
    def longest_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)


@contextmanager
def deployment(cfg: WorkerConfig, num_decode: int, replace_dead: bool) -> Iterator[Router]:
    """1 prefill + `num_decode` decode actors (1 torch thread each), one prefix-cache store, the
    scheduler actor configured as `ferry serve`'s default (its default tenant's loose SLO), and a
    client placing through it, its requests shadowing their KV or not."""
    from actors.ray_actors import start_pd
    from cluster.actor import start_scheduler
    from cluster.router.link import SchedulerLink
    from cluster.router.link_config import LinkConfig
    from deploy.scheduler_config import SchedulerSection

    tag = uuid.uuid4().hex[:6]
    pd = start_pd(cfg, num_prefill=1, num_decode=num_decode, torch_threads=1, name_prefix=f"rb-{tag}",
                  cache=PrefixCacheConfig(dram_bytes=512 * MIB, enable_disk=False), num_cache=1)
    sched_cfg = SchedulerSection().to_scheduler_config()
    scheduler = start_scheduler(sched_cfg, name=f"rb-scheduler-{tag}")
    link = SchedulerLink(scheduler, LinkConfig(report_interval_s=0.1), sched_cfg)
    try:
        yield router_for(pd, CLIENT, control=link, recovery=RecoveryConfig(), replace_dead=replace_dead)
    finally:
        link.close()
        pd.shutdown()
        ray.kill(scheduler, no_restart=True)


async def _shadows_landed(client: Router, victim: str, reqs: list[GenerationRequest], block_size: int) -> bool:
    """Whether `victim` has no shadow offer still on its way to the pool and has shadowed at least
    every full prompt block of `reqs` (the streams it holds)."""
    actor = client.decodes[victim].actor  # type: ignore[attr-defined]
    pool, shadows = await asyncio.gather(actor.pool_stats.remote(), actor.shadow_stats.remote())
    want = sum(len(r.prompt_token_ids) // block_size for r in reqs)
    return pool is not None and shadows is not None and pool.num_pending_offers == 0 and \
        shadows.num_shadow_blocks >= want


async def run_streams(client: Router, reqs: list[GenerationRequest], kill_after: int | None,
                      shadow_block_size: int | None = None) -> dict[str, Any]:
    """Streams `reqs` (each started once the previous one streams); with `kill_after`, kills the
    decode worker holding most of them when every stream has that many tokens, and times its
    replacement. With `shadow_block_size` the kill also waits until the victim's shadows of those
    streams' prompts are in the pool: what a resume from KV costs is measured on KV that exists
    (a kill before they land recomputes, which the `recompute` mode measures)."""
    runs = {r.request_id: Run() for r in reqs}

    async def consume(req: GenerationRequest) -> None:
        run = runs[req.request_id]
        try:
            async for event in client.generate(dataclasses.replace(req, arrival_time=time.time())):
                now = time.perf_counter()
                run.token_ids += event.output.new_token_ids
                run.arrivals += [now] * len(event.output.new_token_ids)
        except Exception as e:  # noqa: BLE001 - counted as a failed stream
            cause = getattr(e, "cause", None) or e  # a worker's own error inside Ray's wrapper
            lines = str(cause).strip().splitlines()
            run.error = f"{type(cause).__name__}: {lines[-1] if lines else ''}"

    # One prompt at a time (the next once the previous streams): each prefill then runs alone, so
    # every run computes the same prompt KV bit for bit; prefills that share a step (or a system
    # prompt one computed for another) round differently in bf16, which no resume can be blamed for.
    started = []
    for r in reqs:
        started.append(asyncio.ensure_future(consume(r)))
        while not runs[r.request_id].token_ids and not started[-1].done():
            await asyncio.sleep(0.005)
    tasks = asyncio.gather(*started)
    killed_at = None
    reps = client.replacements  # None: this scenario does not replace dead workers
    replaced_before = reps.num_replaced if reps is not None else 0
    while not tasks.done():
        if kill_after is not None and killed_at is None and all(len(r.token_ids) >= kill_after for r in runs.values()):
            held: dict[str, int] = {}
            for flight in client.flights.values():
                if flight.decode is not None:
                    held[flight.decode] = held.get(flight.decode, 0) + 1
            victim = max(sorted(held), key=lambda n: held[n])
            on_victim = [r for r in reqs if (f := client.flights.get(r.request_id)) and f.decode == victim]
            if shadow_block_size is not None and not await _shadows_landed(client, victim, on_victim,
                                                                          shadow_block_size):
                await asyncio.sleep(0.02)
                continue
            ray.kill(client.decodes[victim].actor, no_restart=True)  # type: ignore[attr-defined]
            killed_at = time.monotonic()  # the clock of `Replacements.replaced_at`
            for run in runs.values():
                run.at_kill = len(run.token_ids)
            progress(f"  killed {victim} holding {held[victim]} of {len(reqs)} streams")
        await asyncio.sleep(0.005)
    await tasks
    if kill_after is not None and killed_at is None:
        raise RuntimeError("the kill never came: a stream ended (or failed) before every stream had "
                           f"{kill_after} tokens: {[(len(r.token_ids), r.error) for r in runs.values()]}")
    if reps is None:
        return {"runs": runs, "replace_s": None}
    await asyncio.gather(*reps.replacing.values())  # one still starting when every stream had ended
    replaced = killed_at is not None and reps.num_replaced > replaced_before
    return {"runs": runs, "replace_s": reps.replaced_at - killed_at if replaced else None}


async def scenario(cfg: WorkerConfig, reqs: list[GenerationRequest], num_decode: int, replace_dead: bool,
                   kill_after: int, shadow: bool) -> dict[str, Any]:
    recovery: Literal["shadow", "recompute"] = "shadow" if shadow else "recompute"
    with deployment(cfg, num_decode, replace_dead) as client:
        await run_streams(client, _as(reqs[:1], "warm", recovery), None)  # warm-up: the model's code paths
        # Each run under its own tenant, so none reuses another's cached prompt blocks: all three
        # compute their prompts the same way. Two failure-free runs give the noise floor: bf16
        # prefill batching (which requests share a step) can change a later greedy token by itself.
        ref = _renamed((await run_streams(client, _as(reqs, "ref", recovery), None))["runs"], "ref")
        again = _renamed((await run_streams(client, _as(reqs, "again", recovery), None))["runs"], "again")
        failed = await run_streams(client, _as(reqs, "run", recovery), kill_after,
                                   cfg.engine.block_size if shadow else None)
        failed["runs"] = _renamed(failed["runs"], "run")
        resumed = await _resumed_blocks(client)
    runs: dict[str, Run] = failed["runs"]
    ok = [rid for rid, r in runs.items() if r.error is None]
    normal = [r.longest_gap_s for r in ref.values()]
    stalls = [runs[rid].longest_gap_s for rid in ok]
    return {
        "streams": len(reqs), "finished": len(ok),
        "errors": sorted({r.error for r in runs.values() if r.error}),
        "stall_s_p50": statistics.median(stalls) if stalls else None, "stall_s_max": max(stalls, default=None),
        "normal_longest_gap_s_max": max(normal),
        "replace_s": failed["replace_s"],
        "same_tokens_as_failure_free": sum(runs[rid].token_ids == ref[f"{rid}-ref"].token_ids for rid in ok),
        "failure_free_runs_same": sum(again[f"{rid}-again"].token_ids == ref[f"{rid}-ref"].token_ids for rid in (r.request_id for r in reqs)),
        # Streams that already differed before the kill (bf16 prefill batching and prefix reuse can
        # change a first token) say nothing about the resume; the others should all stay the same.
        "same_before_kill": len(same_before := [rid for rid in ok if _same_until(runs[rid], ref[f"{rid}-ref"])]),
        "same_after_resume": sum(runs[rid].token_ids == ref[f"{rid}-ref"].token_ids for rid in same_before),
        "first_difference": sorted(_first_difference(runs[rid], ref[f"{rid}-ref"]) for rid in ok
                                   if runs[rid].token_ids != ref[f"{rid}-ref"].token_ids),
        "resumed_from_kv": resumed[0], "resumed_blocks": resumed[1],
    }


def _as(reqs: list[GenerationRequest], run: str, recovery: Literal["shadow", "recompute"]) -> list[GenerationRequest]:
    """`reqs` as the ingress builds them for tenant `run` (its own cache salt) with `kv_recovery:
    recovery`, ids suffixed with it."""
    policy = RequestPolicy(tenant=run, kv_recovery=recovery)
    return [policy.request(f"{r.request_id}-{run}", r.prompt_token_ids, r.params) for r in reqs]


def _renamed(runs: dict[str, Run], run: str) -> dict[str, Run]:
    """Runs keyed by the original request id plus `-ref` / `-again`, or bare for the failure run."""
    suffix = f"-{run}"
    return {(rid[: -len(suffix)] + ("" if run == "run" else suffix)): r for rid, r in runs.items()}


def _same_until(run: Run, ref: Run) -> bool:
    n = run.at_kill or 0
    return run.token_ids[:n] == ref.token_ids[:n]


def _first_difference(run: Run, ref: Run) -> int:
    return next((i for i, (a, b) in enumerate(zip(run.token_ids, ref.token_ids)) if a != b),
                min(len(run.token_ids), len(ref.token_ids)))


async def _resumed_blocks(client: Router) -> tuple[int, int]:
    """(resumes that imported shadow blocks, blocks imported) over the live workers."""
    stats = []
    for handle in [*client.decodes.values(), *client.prefills.values()]:  # a prefill worker may be lent
        try:
            stats.append(await handle.actor.shadow_stats.remote())  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - the killed worker (or one still starting)
            continue
    live = [s for s in stats if s is not None]
    return sum(s.num_resumed for s in live), sum(s.num_resumed_blocks for s in live)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    """The figures of the scenarios named in `args.scenarios`, on the Ray cluster already started."""
    tok = Tokenizer.load(resolve_model(args.model))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    reqs = [GenerationRequest(f"s{i}", chat(tok, QUESTIONS[i % len(QUESTIONS)]), params)
            for i in range(args.streams)]
    cfg = WorkerConfig(model=args.model, engine=EngineConfig(num_blocks=512, dtype=args.dtype))
    out: dict[str, Any] = {"model": args.model, "config": {
        "streams": args.streams, "max_tokens": args.max_tokens, "kill_after": args.kill_after, "dtype": args.dtype,
        "prompt_tokens": [len(r.prompt_token_ids) for r in reqs]}, "scenarios": {}}
    for name, num_decode, replace_dead in SCENARIOS:
        if name not in args.scenarios:
            continue
        for mode in args.kv_recovery:
            progress(f"{name}, {mode}: starting 1 prefill + {num_decode} decode actors, a cache store and the scheduler")
            out["scenarios"][f"{name} {mode}"] = await scenario(cfg, reqs, num_decode, replace_dead, args.kill_after,
                                                                mode == "shadow")
    return out


def render(f: dict[str, Any]) -> str:
    c = f["config"]
    rows = [[name, f"{s['finished']}/{s['streams']}", s["stall_s_p50"], s["stall_s_max"], s["normal_longest_gap_s_max"],
             s["replace_s"], f"{s['same_tokens_as_failure_free']}/{s['finished']}" if s["finished"] else "-",
             f"{s['same_after_resume']}/{s['same_before_kill']}", f"{s['failure_free_runs_same']}/{s['streams']}",
             f"{s['resumed_from_kv']} ({s['resumed_blocks']} blocks)"]
            for name, s in f["scenarios"].items()]
    table = format_table(["scenario", "finished", "stall p50 s", "stall max s", "gap w/o failure s",
                          "replaced after s", "same tokens", "same after resume", "2 runs w/o failure same",
                          "resumed from KV"], rows,
                         title=f"Decode worker killed after {c['kill_after']} of {c['max_tokens']} tokens, "
                               f"{c['streams']} streams, {c['dtype']}")
    errors = [f"  {name}: {e}" for name, s in f["scenarios"].items() for e in s["errors"]]
    foot = (f"stall = a finished stream's longest gap between two tokens (spans the failure); same after resume = "
            f"streams equal to the failure-free run's, of those equal up to the kill; 2 runs w/o failure same = "
            f"streams equal between two failure-free runs (the bf16 noise floor of prefill batching); prompts "
            f"{min(c['prompt_tokens'])}-{max(c['prompt_tokens'])} tokens; wall {f['wall_s']:.0f} s")
    return "\n".join([table, "", foot] + (["errors of the failed streams:"] + errors if errors else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--kill-after", type=int, default=24, help="tokens every stream has when the kill comes")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--model", default=MODEL, help="known name, .gguf file or HF folder")
    parser.add_argument("--scenarios", default="all",
                        help=f"comma-separated, of: {', '.join(n for n, _, _ in SCENARIOS)} (default all)")
    parser.add_argument("--kv-recovery", default="shadow,recompute",
                        help="comma-separated, of: shadow, recompute (default both, each scenario once per mode)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args()
    args.kv_recovery = [m.strip() for m in args.kv_recovery.split(",")]
    if bad := [m for m in args.kv_recovery if m not in KV_RECOVERY]:
        parser.error(f"unknown --kv-recovery mode(s) {bad}; known: {list(KV_RECOVERY)}")
    if args.streams < 1 or not 1 <= args.kill_after < args.max_tokens:
        parser.error("--streams must be >= 1 and --kill-after between 1 and --max-tokens - 1")
    known = [n for n, _, _ in SCENARIOS]
    args.scenarios = known if args.scenarios == "all" else [n.strip() for n in args.scenarios.split(",")]
    if unknown := [n for n in args.scenarios if n not in known]:
        parser.error(f"unknown scenario(s) {unknown}; known: {known}")
    run_on_local_ray(bench, args, render)


if __name__ == "__main__":
    main()
