"""A request run whole on a decode worker whose rows are all taken (a resume, after its first
worker died) queues in that worker's engine. The router's no-token deadline must not fail it while
it waits there for a row (`cluster/router/follow.py`), and the resume gets the first row that
frees. Real in-process workers on the tiny model, no Ray."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.decode import DecodeWorker
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.sampling import SamplingParams
from actors.errors import WorkerTimeout
from actors.handoff import kv_layout
from actors.messages import GenerationRequest
from cluster.router.client import Router
from cluster.router.config import RecoveryConfig, RouterConfig
from cluster.router.handles import LocalWorkerHandle
from tests.actors.workers.conftest import tiny_model_dir  # noqa: F401 - the fixture
from tests.actors.workers.harness import random_tokens, reference, streamed_ids, worker_config
from transfer.config import make_transport

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture
def one_row(tiny_model_dir: Path) -> Iterator[DecodeWorker]:  # noqa: F811 - the imported fixture
    cfg = worker_config(tiny_model_dir, engine=EngineConfig(num_blocks=96, max_num_seqs=1))
    engine = Engine.from_pretrained(tiny_model_dir, cfg.engine)
    worker = DecodeWorker(cfg, AsyncEngine(engine), make_transport(f"row-{uuid.uuid4().hex[:6]}", cfg.transfer),
                          kv_layout(engine))
    try:
        yield worker
    finally:
        worker.close()


def router(worker: DecodeWorker, row_wait_s: float, token_timeout_s: float = 0.3) -> Router:
    # No recovery at all: a deadline that fires reaches the caller.
    return Router({}, {worker.name: LocalWorkerHandle(worker.name, worker)},
                  RouterConfig(call_timeout_s=10, token_timeout_s=token_timeout_s, row_wait_s=row_wait_s, load_ttl_s=0.0),
                  recovery=RecoveryConfig(max_recoveries=0, probe_timeout_s=2.0, retry_delay_s=0.0))


def hogs(worker: DecodeWorker) -> Router:
    """The row's holder streams through a router of its own, with a deadline a busy box never misses."""
    return router(worker, row_wait_s=0, token_timeout_s=60)


async def stream(r: Router, req: GenerationRequest) -> list[int]:
    return streamed_ids([e async for e in r.generate(req)])


def test_a_resume_waiting_for_the_only_row_is_not_timed_out(one_row: DecodeWorker, tiny_model_dir: Path) -> None:
    long_prompt, prompt = random_tokens(9, seed=71), random_tokens(20, seed=72)
    want = reference(tiny_model_dir, [prompt], SHORT)[0]
    streamed = want[:4]  # what the dead worker had sent

    async def run() -> tuple[list[int], list[int]]:
        r = router(one_row, row_wait_s=120)
        hog = asyncio.ensure_future(stream(hogs(one_row), GenerationRequest("hog", tuple(long_prompt), LONG)))
        while not one_row.engine.engine.scheduler.running:
            await asyncio.sleep(0.01)
        resumed = GenerationRequest("resumed", tuple(prompt), SHORT, output_token_ids=tuple(streamed))
        rest = await stream(r, resumed)
        return rest, await hog

    rest, hog = asyncio.run(run())
    assert streamed + rest == want
    assert len(hog) == LONG.max_tokens


def test_without_row_wait_the_same_resume_times_out(one_row: DecodeWorker) -> None:
    """The control: the wait above is what saves the resume (row_wait_s=0 is the old deadline)."""

    async def run() -> None:
        r = router(one_row, row_wait_s=0)
        hog = asyncio.ensure_future(stream(hogs(one_row), GenerationRequest("hog", tuple(random_tokens(9, seed=71)), LONG)))
        while not one_row.engine.engine.scheduler.running:
            await asyncio.sleep(0.01)
        resumed = GenerationRequest("resumed", tuple(random_tokens(20, seed=72)), SHORT, output_token_ids=(5, 6))
        try:
            with pytest.raises(WorkerTimeout):
                await stream(r, resumed)
        finally:
            hog.cancel()

    asyncio.run(run())
