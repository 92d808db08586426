"""`WorkerHandle` over one replica of a Serve worker deployment (prefill, decode, colocated).

Mental model: the ingress holds one `DeploymentHandle` per worker deployment; a `ServeWorkerHandle`
is that handle plus one replica's id, and every call carries the id as its `multiplexed_model_id`,
so `PinnedRouter` (configured on the deployment) sends it to that replica and no other. Failures are
named as for actors: a replica that is gone (`WorkerGone` from the router, Serve's
`ReplicaUnavailableError`, a dead actor) is `WorkerGone`; any other Ray actor error is
`WorkerUnreachable`. A discarded stream is read to its end in the background (the worker has been
told to abort it), never cancelled from here: Serve's cancel may block the event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

from ray.exceptions import RayActorError
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from actors.messages import GenerationRequest, PrefillResult, Telemetry, TelemetryCursor, TokenEvent, WorkerLoad
from cluster.router.handles import WorkerGone
from cluster.router.ray_handles import drain_in_background, named_failure

T = TypeVar("T")


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
        return await _call(self.name, self._pinned.load.remote())

    async def telemetry(self, cursor: TelemetryCursor | None = None) -> Telemetry:
        return await _call(self.name, self._pinned.telemetry.remote(cursor))

    async def announce(self, req: GenerationRequest) -> bool:
        return await _call(self.name, self._pinned.announce.remote(req))

    async def prefill(self, req: GenerationRequest, decode: str) -> PrefillResult:
        return await _call(self.name, self._pinned.prefill.remote(req, decode))

    async def add_peer(self, metadata: bytes) -> str:
        return await _call(self.name, self._pinned.add_peer.remote(metadata))

    def abort(self, request_id: str) -> Awaitable[Any]:
        return self._pinned.abort.remote(request_id)

    def prefetch(self, req: GenerationRequest) -> Awaitable[Any]:
        return self._pinned.prefetch.remote(req)

    def stream(self, req: GenerationRequest) -> ServeTokenStream:
        return ServeTokenStream(self.name, self._pinned_stream.generate.remote(req))

    def stream_after_kv(self, request_id: str) -> ServeTokenStream:
        return ServeTokenStream(self.name, self._pinned_stream.generate_after_kv.remote(
            request_id))
