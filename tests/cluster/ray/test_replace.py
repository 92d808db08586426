"""Replacing dead workers on a live Ray deployment: what `ferry serve` runs, scaled down to a tiny
model. 1 prefill + 1 decode actor, the scheduler actor, and a `Router` that replaces every
worker it declares dead. The lone decode worker is killed with streams in flight: no other decode
worker can take them, so they resume on the prefill worker, lent until the replacement is up (by
recompute: this deployment has no prefix pool, so no KV shadows), and finish with exactly the
tokens and text of a failure-free run. Then the lone prefill worker is killed between requests: the client notices on
a load poll, replaces it, and later prompts are prefilled by the new actor and handed to the
decode worker. Last, a colocated worker (the baseline app's kind) killed mid-stream. The
disaggregated tests share one deployment and run in file order."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from actors.messages import GenerationRequest
from actors.worker_config import WorkerConfig
from cluster.router.config import RecoveryConfig
from cluster.router.ray_handles import router_for
from tests.actors.workers.harness import random_tokens
from tests.cluster.ray.test_failures import (CLIENT, GREEDY, Deployment, Stream, assert_no_leaks,
                                             assert_same_as_failure_free, deployment, make_requests, reference,
                                             run_with_failure, worker_config)

pytestmark = [pytest.mark.ray, pytest.mark.slow]
RECOVERY = RecoveryConfig(gather_s=3.0, probe_timeout_s=10.0, replace_wait_s=120.0, replace_backoff_s=0.5)


@pytest.fixture(scope="module")
def dep(ray_cluster: ModuleType, tiny_model_dir: Path) -> Iterator[Deployment]:
    yield from deployment(ray_cluster, tiny_model_dir, 1, RECOVERY, replace_dead=True, prefix="heal")


def test_lone_decode_worker_killed_with_streams_in_flight_is_replaced_and_they_finish(dep: Deployment) -> None:
    import ray

    reqs = make_requests("rd", [5, 17, 33, 48], seed=5000)
    want = reference(dep.model, reqs)
    name = dep.decodes[0]
    old = dep.pd.decodes[name]  # type: ignore[attr-defined]

    def strike(streams: dict[str, Stream]) -> bool:
        if any(len(s.events) < 12 for s in streams.values()):
            return False
        ray.kill(old, no_restart=True)
        return True

    started = time.monotonic()
    streams = asyncio.run(run_with_failure(dep, reqs, strike))
    assert_same_as_failure_free(streams, want)
    new = dep.pd.decodes[name]  # type: ignore[attr-defined]
    reps = dep.client.replacements
    assert new is not old and dep.client.decodes[name].actor is new  # type: ignore[attr-defined]
    assert reps is not None and reps.num_replaced == 1 and not dep.client.board.dead and not reps.replacing
    records = dep.new_records()
    assert {r.request_id for r in records} == {r.request_id for r in reqs}  # every stream lost its worker
    assert all(r.decode == dep.prefills[0] and r.round == 0 and 12 <= r.num_streamed for r in records)  # lent
    print(f"4 streams resumed on the lent prefill worker, replaced after {time.monotonic() - started:.1f} s in all")
    assert_no_leaks(dep)


def test_lone_prefill_worker_killed_between_requests_is_replaced_and_prefills_again(dep: Deployment) -> None:
    import ray

    name = dep.prefills[0]
    old = dep.pd.prefills[name]  # type: ignore[attr-defined]
    ray.kill(old, no_restart=True)
    reqs = [GenerationRequest(f"rp-{i}", random_tokens(n, seed=6000 + i), replace(GREEDY, max_tokens=12),
                              tenant="t0") for i, n in enumerate((40, 75, 130))]
    want = reference(dep.model, reqs)

    async def main() -> list[Stream]:
        deadline = time.monotonic() + 120
        reps = dep.client.replacements
        assert reps is not None
        while reps.num_replaced < 2:  # load polls find the dead actor and start a replacement
            assert time.monotonic() < deadline, ("no replacement", dep.client.board.dead, list(reps.replacing))
            await dep.client.loads()
            await asyncio.sleep(0.1)
        out = [Stream(r) for r in reqs]
        for s in out:
            s.events = [e async for e in dep.client.generate(s.req)]
        return out

    streams = asyncio.run(main())
    assert_same_as_failure_free({s.req.request_id: s for s in streams}, want)
    new = dep.pd.prefills[name]  # type: ignore[attr-defined]
    assert new is not old and dep.client.prefills[name].actor is new and not dep.client.board.dead  # type: ignore[attr-defined]
    for r in reqs:  # handed off: prefilled by the new actor, which learned the decode endpoint
        result = dep.client.prefill_result(r.request_id)
        assert result is not None and result.worker == name and result.num_computed_tokens > 0
    assert_no_leaks(dep)


def test_colocated_worker_killed_mid_stream_is_replaced(ray_cluster: ModuleType, tiny_model_dir: Path) -> None:
    import ray

    from actors.ray_actors import start_colocated

    pd = start_colocated(worker_config(tiny_model_dir), torch_threads=1, name_prefix=f"colo-{uuid.uuid4().hex[:4]}")
    try:
        client = router_for(pd, CLIENT, recovery=RECOVERY, replace_dead=True)  # as the colocated app
        dep = Deployment(tiny_model_dir, pd, None, None, client)  # type: ignore[arg-type]
        reqs = make_requests("rc", [9, 30], seed=7000)
        want = reference(tiny_model_dir, reqs)
        (name, old), = pd.decodes.items()

        def strike(streams: dict[str, Stream]) -> bool:
            if any(len(s.events) < 8 for s in streams.values()):
                return False
            ray.kill(old, no_restart=True)
            return True

        streams = asyncio.run(run_with_failure(dep, reqs, strike))
        assert_same_as_failure_free(streams, want)
        reps = client.replacements
        assert reps is not None and reps.num_replaced == 1 and pd.decodes[name] is not old
        assert client.decodes[name].actor is pd.decodes[name]  # type: ignore[attr-defined]
        assert_no_leaks(dep)
    finally:
        pd.shutdown()


def test_replace_refuses_what_it_cannot_build() -> None:
    from actors.ray_actors import PDDeployment

    with pytest.raises(RuntimeError, match="not started with its WorkerConfig"):
        asyncio.run(PDDeployment({}, {"d": object()}).replace("d"))  # type: ignore[dict-item]
    with pytest.raises(KeyError, match="no worker named 'x'"):
        asyncio.run(PDDeployment({}, {}, cfg=WorkerConfig(model="m")).replace("x"))
    stopped = PDDeployment({}, {}, cfg=WorkerConfig(model="m"))
    stopped.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(stopped.replace("x"))
