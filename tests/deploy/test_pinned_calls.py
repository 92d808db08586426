"""Calls pinned to replicas (`ServeWorkerHandle`, `PinnedRouter`) made inside one Serve request, as
the ingress makes them (an HTTP stream's announce and prefill, the load polls a request's task
spawned), each run on their own replica and at once. Serve's router tells pending calls apart by an
internal request id such calls inherit from the request; before each call got its own, calls to two
replicas under one request ran on each other's replica or waited on each other's routing, and
streams pinned to one replica ran two at a time."""

from __future__ import annotations

import asyncio
from types import ModuleType

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STREAMS = 4  # per replica, all open at once


def test_pinned_calls_in_one_request_reach_their_replicas_concurrently(ray_cluster: ModuleType) -> None:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cluster.router.pinned_router import PinnedRouter
    from cluster.router.serve_handles import ServeWorkerHandle

    @serve.deployment(num_replicas=2, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0.1},
                      request_router_config=RequestRouterConfig(request_router_class=PinnedRouter))
    class Worker:
        def __init__(self) -> None:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
            self.open = 0
            self.all_open = asyncio.Event()

        async def identify(self) -> str:
            return self.replica_id

        async def load(self) -> str:
            return self.replica_id

        async def generate(self, _: object):  # type: ignore[no-untyped-def]
            self.open += 1
            if self.open == STREAMS:
                self.all_open.set()
            await asyncio.wait_for(self.all_open.wait(), 60)  # only when all STREAMS are open here at once
            yield self.replica_id

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0.1})
    class Caller:
        def __init__(self, workers) -> None:  # type: ignore[no-untyped-def]
            self.workers = workers

        async def run(self) -> tuple[list[tuple[str, str]], list[tuple[str, list[str]]]]:
            ids = await self.workers.broadcast("identify").results_async(timeout_s=60)
            handles = [ServeWorkerHandle(f"w{i}", rid, self.workers) for i, rid in enumerate(sorted(ids))]
            loads = await asyncio.gather(*(h.load() for _ in range(10) for h in handles))
            calls = [(h.replica_id, got) for h, got in zip(handles * 10, loads)]

            async def read(h: ServeWorkerHandle) -> tuple[str, list[str]]:
                return h.replica_id, [e async for e in h.stream(None)]  # type: ignore[arg-type]

            streams = await asyncio.gather(*(read(h) for _ in range(STREAMS) for h in handles))
            return calls, streams

    serve.start(proxy_location="Disabled")  # handle calls only: no HTTP proxy
    try:
        handle = serve.run(Caller.bind(Worker.bind()), name="pinned-calls", route_prefix=None)
        calls, streams = handle.run.remote().result(timeout_s=120)
    finally:
        serve.shutdown()  # the next test in this worker starts Serve with its own HTTP options
    assert len({want for want, _ in calls}) == 2
    assert all(got == want for want, got in calls), calls
    assert all(got == [want] for want, got in streams), streams
