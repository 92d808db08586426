"""Workers report their engines' steps and prefix caches; the scheduler fits its step-time models
and prefix index from them, applying each report once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from actors.engine.config import EngineConfig
from actors.engine.output import StepRecord
from actors.handoff import prompt_block_hashes
from actors.messages import GenerationRequest, Telemetry, TelemetryCursor
from actors.telemetry import TelemetryLog
from cluster.router.adapters import request_desc, telemetry_cursor, worker_load, worker_telemetry
from cluster.config import SchedulerConfig
from cluster.cost_model import StepCostPrior, StepTimeModel
from cluster.descriptors import WorkerName
from cluster.placement import Placement
from cluster.service import SchedulerService
from tests.actors.workers.harness import GREEDY, LocalCluster, random_tokens, worker_config

PROMPT_LENS = (40, 90, 150, 230, 310)


def test_engine_steps_fit_the_schedulers_models_and_cached_blocks_steer_placement(tiny_model_dir: Path) -> None:
    cfg = worker_config(tiny_model_dir, engine=EngineConfig(num_blocks=256))
    reqs = [GenerationRequest(f"t{i}", random_tokens(n, seed=i), GREEDY) for i, n in enumerate(PROMPT_LENS)]

    async def main() -> tuple[LocalCluster, dict[str, Telemetry], list]:
        cluster = await LocalCluster.start(cfg, num_prefill=2)
        for r in reqs:
            await cluster.run(r, prefill=0)
        workers = [*cluster.prefills, cluster.decode]
        tele = {w.name: await w.telemetry(None) for w in workers}  # type: ignore[union-attr]
        loads = [await w.load() for w in workers]  # type: ignore[union-attr]
        return cluster, tele, loads

    cluster, tele, loads = asyncio.run(main())
    try:
        p0, p1, dec = cluster.prefills[0], cluster.prefills[1], cluster.decode
        assert dec is not None
        tp, td = tele[p0.name], tele[dec.name]
        # Every step is reported with its work: p0 computed each prompt (in prefill-only steps),
        # the decode worker sampled 8 tokens per request, each a one-token row with context.
        assert len(tp.steps) == p0.engine.engine.stats().num_steps > 0
        assert sum(s.num_prefill_tokens for s in tp.steps) == sum(PROMPT_LENS)
        assert all(s.num_decode_seqs == 0 and s.step_s > 0 for s in tp.steps)
        assert sum(s.num_decode_seqs for s in td.steps) == len(reqs) * GREEDY.max_tokens
        assert tele[p1.name].steps == () and tele[p1.name].cached_full == frozenset()
        held = {h for r in reqs for h in prompt_block_hashes(r, 16)[: (r.num_prompt_tokens - 1) // 16]}
        assert tp.cached_full is not None and held <= tp.cached_full

        svc = SchedulerService(SchedulerConfig(heartbeat_timeout_s=1e6))
        ack = svc.report("ingress", [], [worker_load(w, 0.0, 16) for w in loads],
                         [worker_telemetry(t) for t in tele.values()])
        # Each worker's step-time model is exactly the regression on its engine's measured steps
        # (not the H200 prior any more), and the decode view learns its rows' mean context.
        prior = StepTimeModel(StepCostPrior()).coefficients
        for name, t in ((p0.name, tp), (dec.name, td)):
            fitted = svc.sched.models.get(WorkerName(name))
            ref = StepTimeModel(StepCostPrior())
            ref.observe_all(worker_telemetry(t).steps)
            assert fitted.num_samples == len(t.steps) and fitted.coefficients == ref.coefficients != prior
        view = svc.sched.workers.get(WorkerName(dec.name))
        rows = sum(s.num_decode_seqs for s in td.steps)
        assert view is not None and view.mean_context_tokens == sum(s.num_context_tokens for s in td.steps) / rows
        # The same window again (another ingress, a re-send) is applied once; a read after the
        # scheduler's cursor brings nothing new.
        fitted = svc.sched.models.get(WorkerName(p0.name))
        svc.report("ingress-2", [], [], [worker_telemetry(tp)])
        assert fitted.num_samples == len(tp.steps)
        cursor = telemetry_cursor(ack.cursors[p0.name])
        assert cursor == TelemetryCursor(tp.incarnation, tp.first_step_seq + len(tp.steps) - 1, tp.cache_seq)
        again = asyncio.run(p0.telemetry(cursor))
        assert again.steps == () and again.cache_changes == () and again.cached_full is None

        # A prompt sharing t4's first 300 tokens goes to p0, which holds them, not to idle p1.
        follow = GenerationRequest("f", list(reqs[4].prompt_token_ids[:300]) + random_tokens(60, seed=99), GREEDY)
        hashes = tuple(prompt_block_hashes(follow, 16))
        placed = svc.submit(request_desc(follow, hashes))
        assert isinstance(placed, Placement)
        assert placed.prefill_worker == p0.name and placed.num_prefix_hit_blocks == 300 // 16
    finally:
        cluster.close()


class _FakeEngine:
    """What `TelemetryLog` reads of an `AsyncEngine`: step records and cached hashes."""

    def __init__(self) -> None:
        self.engine = self
        self.records: list[StepRecord] = []
        self.held: set[int] = set()

    def take_step_records(self) -> list[StepRecord]:
        out, self.records = self.records, []
        return out

    def cached_block_hashes(self) -> list[int]:
        return list(self.held)

    def locked(self, fn, *args):  # type: ignore[no-untyped-def]
        return fn(*args)


def _step(i: int) -> StepRecord:
    return StepRecord(i, float(i), 0, 0, 0.001 * i)


def test_log_numbers_steps_and_cache_changes_and_falls_back_to_the_whole_set() -> None:
    fake = _FakeEngine()
    log = TelemetryLog("w", fake, max_steps=4, max_changes=2, cache_interval_s=0.0)  # type: ignore[arg-type]
    fake.records, fake.held = [_step(1), _step(2)], {10, 11}
    first = log.read(None)
    assert (first.first_step_seq, first.steps, first.cache_seq, first.cached_full) == (1, (_step(1), _step(2)), 1,
                                                                                        frozenset({10, 11}))
    fake.records, fake.held = [_step(3)], {11, 12}
    nxt = log.read(first.cursor)
    assert (nxt.first_step_seq, nxt.steps, nxt.cache_changes, nxt.cached_full) == (3, (_step(3),),
                                                                                   ((2, (12,), (10,)),), None)
    assert log.read(nxt.cursor).steps == () and log.read(nxt.cursor).cache_changes == ()
    # Only the last 4 steps and 2 changes are kept: an older cursor gets what is left, and the
    # whole set of hashes instead of changes it could not apply.
    for k in range(4, 9):
        fake.records, fake.held = [_step(k)], {11, 12, 100 + k}
        log.read(nxt.cursor)
    late = log.read(nxt.cursor)
    assert [s.num_prefill_tokens for s in late.steps] == [5, 6, 7, 8] and late.first_step_seq == 5
    assert late.cached_full == frozenset({11, 12, 108}) and late.cache_changes == ()
    assert log.read(TelemetryCursor("another process", 8, 7)).cached_full == frozenset({11, 12, 108})
