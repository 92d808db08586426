"""Recovery from KV shadows through the router (in-process workers sharing a prefix-cache pool, no
Ray): a decode worker killed with 6 streams in flight, in bfloat16; every stream resumes on the
other decode worker from its shadowed blocks and ends with exactly the tokens of the run without
the kill. With shadowing off (a tenant that chose recompute) the same kill resumes by recompute. A
lone decode worker's streams resume on the prefill worker, lent until a decode worker is back."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Literal

import pytest

from actors.decode import DecodeWorker
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.sampling import SamplingParams
from actors.handoff import kv_layout
from actors.messages import GenerationRequest, RequestPolicy
from actors.prefill import PrefillWorker
from cluster.router.client import Router
from cluster.router.config import RecoveryConfig, RouterConfig
from cluster.router.handles import LocalWorkerHandle
from tests.actors.workers.conftest import tiny_model_dir  # noqa: F401 - the fixture
from tests.actors.workers.harness import random_tokens, streamed_ids, worker_config
from tests.actors.workers.test_pool import make_pool
from transfer.config import make_transport

PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
LENGTHS = [37, 70, 53, 100, 21, 64]


class PooledWorkers:
    """1 prefill + `num_decode` decode workers in this process over one prefix-cache pool, in bfloat16."""

    def __init__(self, model: Path, tmp: Path, num_decode: int = 2) -> None:
        cfg = worker_config(model, engine=EngineConfig(num_blocks=160, dtype="bfloat16"))
        pool, _ = make_pool(tmp)
        tag = uuid.uuid4().hex[:6]
        self.decode_workers = []
        for i in range(num_decode):
            engine = Engine.from_pretrained(model, cfg.engine)
            self.decode_workers.append(DecodeWorker(cfg, AsyncEngine(engine), make_transport(f"d{i}-{tag}", cfg.transfer),
                                                    kv_layout(engine), prefix_pool=pool))
        engine = Engine.from_pretrained(model, cfg.engine)
        self.prefill = PrefillWorker(cfg, AsyncEngine(engine), make_transport(f"p0-{tag}", cfg.transfer),
                                     kv_layout(engine), pool)
        self.decodes = {d.name: LocalWorkerHandle(d.name, d) for d in self.decode_workers}
        self.prefills = {self.prefill.name: LocalWorkerHandle(self.prefill.name, self.prefill)}

    async def router(self) -> Router:
        for d in self.decode_workers:
            await self.prefill.add_peer(d.transport_metadata())
        return Router(self.prefills, self.decodes, RouterConfig(call_timeout_s=30, prefill_timeout_s=60,
                                                                token_timeout_s=30, load_ttl_s=0.0),
                      recovery=RecoveryConfig(gather_s=0.2, probe_timeout_s=2.0, retry_delay_s=0.0))

    def close(self) -> None:
        self.prefill.close()
        for d in self.decode_workers:
            d.close()


async def _streams(router: Router, reqs: list[GenerationRequest], workers: PooledWorkers | None,
                   kill_after: int | None) -> tuple[dict[str, list[int]], int]:
    """Streams `reqs` at once; with `kill_after`, kills the decode worker of the first stream to
    have that many tokens once all have. (tokens per stream, streams the victim held)"""
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    killed: list[str] = []
    held: list[int] = []

    async def consume(req: GenerationRequest) -> None:
        async with contextlib.aclosing(router.generate(req)) as stream:
            async for event in stream:
                got[req.request_id] += event.output.new_token_ids
                if kill_after is not None and not killed and all(len(g) >= kill_after for g in got.values()):
                    victim = router.flights[req.request_id].decode
                    assert victim is not None and workers is not None
                    killed.append(victim)
                    held.append(sum(f.decode == victim for f in router.flights.values()))
                    workers.decodes[victim].kill()
                    # as a SIGKILL: its engine stops too (no zombie finishing the streams)
                    next(d for d in workers.decode_workers if d.name == victim).engine.shutdown()

    await asyncio.gather(*(consume(r) for r in reqs))
    assert kill_after is None or killed
    return got, held[0] if held else 0


def as_tenant_runs(req: GenerationRequest, recovery: Literal["shadow", "recompute"],
                   request_id: str | None = None) -> GenerationRequest:
    """`req` as the ingress builds it for a tenant with `kv_recovery: recovery` (a shadowed request
    gets its own secret shadow key)."""
    policy = RequestPolicy(tenant=req.tenant, kv_recovery=recovery)
    return policy.request(request_id or req.request_id, req.prompt_token_ids, req.params)


async def _reference_then_kill(workers: PooledWorkers, reqs: list[GenerationRequest], shadow: bool) -> tuple[
        dict[str, list[int]], dict[str, list[int]], int, PooledWorkers]:
    """The streams once without a failure (ids suffixed -ref), then with their decode worker killed
    after 12 tokens: (reference tokens, tokens, streams the victim held, the workers, closed)."""
    recovery = "shadow" if shadow else "recompute"
    try:
        router = await workers.router()
        want, _ = await _streams(router, [as_tenant_runs(r, recovery, f"{r.request_id}-ref") for r in reqs], None, None)
        got, held = await _streams(router, [as_tenant_runs(r, recovery) for r in reqs], workers, kill_after=12)
        return want, got, held, workers
    finally:
        workers.close()


@pytest.mark.parametrize("shadow", [True, False], ids=["shadow", "recompute"])
def test_streams_of_a_killed_decode_worker_resume_from_their_kv(tiny_model_dir: Path, tmp_path: Path,
                                                                shadow: bool) -> None:
    reqs = [GenerationRequest(f"k{i}", random_tokens(n, seed=700 + i), PARAMS) for i, n in enumerate(LENGTHS)]

    want, got, held, workers = asyncio.run(_reference_then_kill(PooledWorkers(tiny_model_dir, tmp_path), reqs, shadow))
    resumed = sum(s.num_resumed for d in workers.decode_workers if (s := d.shadow_stats()) is not None)
    assert held >= 1 and all(len(g) == PARAMS.max_tokens for g in got.values())
    if shadow:
        assert resumed == held
        assert all(got[r.request_id] == want[f"{r.request_id}-ref"] for r in reqs)
    else:
        assert resumed == 0


def test_a_lone_decode_workers_streams_resume_on_the_prefill_worker(tiny_model_dir: Path, tmp_path: Path) -> None:
    reqs = [GenerationRequest(f"l{i}", random_tokens(n, seed=800 + i), PARAMS) for i, n in enumerate(LENGTHS[:4])]

    workers = PooledWorkers(tiny_model_dir, tmp_path, num_decode=1)
    want, got, held, workers = asyncio.run(_reference_then_kill(workers, reqs, shadow=True))
    assert held == len(reqs)
    lent = workers.prefill.shadow_stats()
    assert lent is not None and lent.num_resumed == len(reqs)
    assert all(got[r.request_id] == want[f"{r.request_id}-ref"] for r in reqs)


def test_a_preempted_row_comes_back_from_its_kv(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Preemption by swap: the row's KV stays in the pool (shadowed); the resumed row imports it."""
    req = GenerationRequest("p0", random_tokens(70, seed=810), PARAMS)

    async def main() -> tuple[list[int], list[int], PooledWorkers]:
        workers = PooledWorkers(tiny_model_dir, tmp_path, num_decode=1)
        try:
            router = await workers.router()
            refs, _ = await _streams(router, [as_tenant_runs(req, "shadow", "p0-ref")], None, None)
            want = refs["p0-ref"]
            got: list[int] = []
            async for event in router.generate(as_tenant_runs(req, "shadow")):
                got += event.output.new_token_ids
                if len(got) >= 10 and router.preemptions.num_preempted == 0:
                    assert router.preempt(req.request_id)  # no scheduler: it resumes here within 0.5 s
            assert router.preemptions.num_preempted == 1 and router.preemptions.num_resumed_locally == 1
            return want, got, workers
        finally:
            workers.close()

    want, got, workers = asyncio.run(main())
    stats = workers.decode_workers[0].shadow_stats()
    assert stats is not None and stats.num_resumed == 1 and stats.num_resumed_blocks >= 4
    assert got == want
