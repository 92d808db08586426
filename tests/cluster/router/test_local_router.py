"""The router over in-process workers (`LocalWorkerHandle`), no Ray: real prefill and decode workers
on a tiny model over the in-process transport. Requests stream the single-engine reference tokens
whichever decode worker they land on, and a decode worker that dies mid-stream (`kill`) costs its
streams nothing but a resume on the other one: the same tokens and text, no leaked blocks."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.decode import DecodeWorker
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.sampling import SamplingParams
from actors.handoff import kv_layout
from actors.messages import GenerationRequest
from actors.prefill import PrefillWorker
from actors.errors import Refused
from cluster.router.client import Router
from cluster.router.config import RecoveryConfig, RouterConfig
from cluster.router.handles import LocalWorkerHandle
from tests.actors.workers.conftest import tiny_model_dir  # noqa: F401 - the fixture
from tests.actors.workers.harness import random_tokens, reference, streamed_ids, streamed_text, worker_config
from transfer.config import make_transport

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


class Workers:
    """1 prefill + 2 decode workers in this process, each behind a `LocalWorkerHandle`."""

    def __init__(self, model: Path) -> None:
        cfg = worker_config(model, engine=EngineConfig(num_blocks=96))
        tag = uuid.uuid4().hex[:6]
        self.decode_workers: list[DecodeWorker] = []
        for i in range(2):
            engine = Engine.from_pretrained(model, cfg.engine)
            self.decode_workers.append(DecodeWorker(cfg, AsyncEngine(engine), make_transport(f"d{i}-{tag}", cfg.transfer),
                                                    kv_layout(engine)))
        engine = Engine.from_pretrained(model, cfg.engine)
        self.prefill = PrefillWorker(cfg, AsyncEngine(engine), make_transport(f"p0-{tag}", cfg.transfer), kv_layout(engine))
        self.decodes = {d.name: LocalWorkerHandle(d.name, d) for d in self.decode_workers}
        self.prefills = {self.prefill.name: LocalWorkerHandle(self.prefill.name, self.prefill)}

    async def wire(self) -> None:
        for d in self.decode_workers:
            assert await self.prefill.add_peer(d.transport_metadata()) == d.name

    def router(self) -> Router:
        return Router(self.prefills, self.decodes, RouterConfig(call_timeout_s=30, prefill_timeout_s=60,
                                                                token_timeout_s=30, load_ttl_s=0.0),
                      recovery=RecoveryConfig(gather_s=0.2, probe_timeout_s=2.0, retry_delay_s=0.0))

    def close(self) -> None:
        self.prefill.close()
        for d in self.decode_workers:
            d.close()


@pytest.fixture
def workers(tiny_model_dir: Path) -> Iterator[Workers]:  # noqa: F811 - the imported fixture
    w = Workers(tiny_model_dir)
    try:
        yield w
    finally:
        w.close()


def requests(prefix: str, lengths: list[int]) -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}-{i}", random_tokens(n, seed=900 + i), PARAMS) for i, n in enumerate(lengths)]


def test_requests_stream_the_reference_tokens_through_the_router(workers: Workers, tiny_model_dir: Path) -> None:
    reqs = requests("ok", [1, 9, 33, 40])  # a 1-token prompt runs on a decode worker alone
    want = reference(tiny_model_dir, [list(r.prompt_token_ids) for r in reqs], PARAMS)

    async def main() -> list[list[int]]:
        await workers.wire()
        router = workers.router()
        async def collect(req: GenerationRequest) -> list:
            return [e async for e in router.generate(req)]

        outs = await asyncio.gather(*(collect(r) for r in reqs))
        assert not router.flights and router.board.in_flight.total() == 0
        return [streamed_ids(events) for events in outs]

    assert asyncio.run(main()) == want
    for d in workers.decode_workers:
        d.engine.engine.check_integrity()


def test_a_decode_worker_killed_mid_stream_is_survived_on_the_other_one(workers: Workers, tiny_model_dir: Path) -> None:
    reqs = requests("kill", [12, 30, 21])
    want = reference(tiny_model_dir, [list(r.prompt_token_ids) for r in reqs], PARAMS)

    async def main() -> tuple[dict[str, list[int]], Router, str]:
        await workers.wire()
        router = workers.router()
        events: dict[str, list] = {r.request_id: [] for r in reqs}
        killed: list[str] = []

        async def consume(req: GenerationRequest) -> None:
            async with contextlib.aclosing(router.generate(req)) as stream:
                async for event in stream:
                    events[req.request_id].append(event)
                    if not killed and all(len(e) >= 6 for e in events.values()):
                        victim = router.flights[req.request_id].decode
                        assert victim is not None
                        killed.append(victim)
                        workers.decodes[victim].kill()

        await asyncio.gather(*(consume(r) for r in reqs))
        assert killed and router.board.dead == set(killed)
        return events, router, killed[0]

    events, router, victim = asyncio.run(main())
    assert [streamed_ids(events[r.request_id]) for r in reqs] == want  # float32: the resume is exact
    for r in reqs:  # one stream: the text of every event adds up to the final text
        assert streamed_text(events[r.request_id]) == events[r.request_id][-1].output.text
    assert any(rec.dead == (victim,) for rec in router.recoveries.log)
    survivor = next(d for d in workers.decode_workers if d.name != victim)
    survivor.engine.engine.check_integrity()


class _StaleScheduler:
    """A control plane whose view lags: it says "no healthy worker" twice, then lets the router place."""

    available, preempt_batch = True, False

    def __init__(self) -> None:
        self.refusals = 2

    def attach(self, source: object) -> None: ...
    def fallback_rank(self, req: object) -> int: return 0
    def on_placed(self, flight: object) -> None: ...
    def on_stage(self, *a: object) -> None: ...
    def on_tokens(self, *a: object) -> None: ...
    def on_done(self, *a: object) -> None: ...
    def on_preempted(self, flight: object) -> None: ...

    async def admit(self, req: object) -> None:
        if self.refusals:
            self.refusals -= 1
            raise Refused("no_healthy_worker", status=503, retry_after_s=1.0)
        return None  # away: the router places it


def test_a_schedulers_stale_no_healthy_worker_is_waited_out_when_the_router_sees_workers(
        workers: Workers, tiny_model_dir: Path) -> None:
    reqs = requests("stale", [9])
    want = reference(tiny_model_dir, [list(r.prompt_token_ids) for r in reqs], PARAMS)
    control = _StaleScheduler()

    async def main() -> list[int]:
        await workers.wire()
        router = Router(workers.prefills, workers.decodes, RouterConfig(load_ttl_s=0.0), control=control)  # type: ignore[arg-type]
        return streamed_ids([e async for e in router.generate(reqs[0])])

    assert [asyncio.run(main())] == want and control.refusals == 0


def test_a_scheduler_that_keeps_seeing_no_worker_is_overruled_by_the_routers_fresher_view(
        workers: Workers, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the settle time a scheduler still answering no_healthy_worker while this router sees a
    healthy worker of every kind is stale: the request is placed here and served, not refused."""
    import cluster.router.client as client_module

    monkeypatch.setattr(client_module, "_SETTLE_S", 0.5)
    reqs = requests("overruled", [9])
    want = reference(tiny_model_dir, [list(r.prompt_token_ids) for r in reqs], PARAMS)
    control = _StaleScheduler()
    control.refusals = 10**6  # never comes round

    async def main() -> list[int]:
        await workers.wire()
        router = Router(workers.prefills, workers.decodes, RouterConfig(load_ttl_s=0.0), control=control)  # type: ignore[arg-type]
        return streamed_ids([e async for e in router.generate(reqs[0])])

    assert [asyncio.run(main())] == want and control.refusals < 10**6
