"""`WorkerHandle` over one replica of a Serve worker deployment (prefill, decode, colocated).

Mental model: the ingress holds one `DeploymentHandle` per worker deployment; a `ServeWorkerHandle`
is that handle plus one replica's id, and every call carries the id as its `multiplexed_model_id`,
so `PinnedRouter` (configured on the deployment) sends it to that replica and no other. Failures are
named as for actors: a replica that is gone (`WorkerGone` from the router, Serve's
`ReplicaUnavailableError`, a dead actor) is `WorkerGone`; any other Ray actor error is
`WorkerUnreachable`. A discarded stream is read to its end in the background (the worker has been
told to abort it), never cancelled from here: Serve's cancel may block the event loop.
Every call is sent as a request of its own (`_own`): Serve's router tells pending calls apart by
an internal request id that a call made inside a request (an HTTP stream, or a task it spawned,
such as the load polls) inherits from it, so calls pinned to different replicas under one request
matched each other's routing: a call ran on another call's replica, or waited until another's
routing fulfilled it (seen: a new decode replica's loads answered late or by the old one).
So Serve no longer cancels them with the request (it finds a request's calls by that id): the router
ends a call itself (a stream's abort, a discarded stream drained), as it did before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable
from typing import Any, TypeVar

from ray.exceptions import RayActorError
from ray.serve import context as serve_context
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from actors.messages import GenerationRequest, PrefillResult, Telemetry, TelemetryCursor, TokenEvent, WorkerLoad
from cluster.router.handles import WorkerGone
from cluster.router.ray_handles import drain_in_background, named_failure

T = TypeVar("T")


def _own(method: Any, *args: Any) -> Any:
    """`method.remote(*args)` with an internal request id of its own (Serve reads it from the request
    context when the call is made; an empty one makes it draw a fresh one)."""
    ctx = serve_context._get_serve_request_context()
    token = serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=""))
    try:
        return method.remote(*args)
    finally:
        serve_context._serve_request_context.reset(token)


async def _call(name: str, response: Awaitable[T]) -> T:
    try:
        return await response
    except ReplicaUnavailableError as e:
        raise WorkerGone(f"worker {name} is gone: {e}") from e
    except RayActorError as e:
        raise named_failure(name, e) from e


class ServeTokenStream:
    def __init__(self, name: str, gen: Any) -> None:
        self._name = name
        self._gen = gen

    def __aiter__(self) -> ServeTokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        return await _call(self._name, self._gen.__anext__())

    def discard(self) -> None:
        async def consume() -> None:
            async for _ in self._gen:
                pass

        drain_in_background(consume())


class ServeWorkerHandle:
    """Replica `replica_id` of the deployment behind `handle`, known to the router as `name`."""

    def __init__(self, name: str, replica_id: str, handle: DeploymentHandle) -> None:
        self.name = name
        self.replica_id = replica_id
        self.handle = handle  # the deployment's (ServeReplacer tells kinds apart by it)
        self._pinned = handle.options(multiplexed_model_id=replica_id)
        self._pinned_stream = handle.options(multiplexed_model_id=replica_id, stream=True)

    async def load(self) -> WorkerLoad:
        return await _call(self.name, _own(self._pinned.load))

    async def telemetry(self, cursor: TelemetryCursor | None = None) -> Telemetry:
        return await _call(self.name, _own(self._pinned.telemetry, cursor))

    async def announce(self, req: GenerationRequest) -> bool:
        return await _call(self.name, _own(self._pinned.announce, req))

    async def prefill(self, req: GenerationRequest, decode: str) -> PrefillResult:
        return await _call(self.name, _own(self._pinned.prefill, req, decode))

    async def add_peer(self, metadata: bytes) -> str:
        return await _call(self.name, _own(self._pinned.add_peer, metadata))

    def abort(self, request_id: str) -> Awaitable[Any]:
        return _own(self._pinned.abort, request_id)

    def prefetch(self, req: GenerationRequest) -> Awaitable[Any]:
        return _own(self._pinned.prefetch, req)

    def stream(self, req: GenerationRequest) -> ServeTokenStream:
        return ServeTokenStream(self.name, _own(self._pinned_stream.generate, req))

    def stream_after_kv(self, request_id: str) -> ServeTokenStream:
        return ServeTokenStream(self.name, _own(self._pinned_stream.generate_after_kv, request_id))
