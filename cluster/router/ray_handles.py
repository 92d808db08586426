"""`WorkerHandle` over a Ray actor: Ray at the router's edge.

Mental model: each method starts the actor call at once and awaits its ref; Ray's failures become
the router's named ones (`ActorDiedError` -> `WorkerGone`, any other `RayActorError` ->
`WorkerUnreachable`). Exceptions a worker raised itself cross Ray as subclasses of their own
class, so they pass through untouched. A stream is Ray's streaming generator; a discarded one is
read to its end in the background, so the refs failed by the abort are consumed instead of being
logged by Ray as unhandled errors. `router_for` builds a `Router` over a deployment's actors.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, RayActorError

from actors.messages import GenerationRequest, PrefillResult, Telemetry, TelemetryCursor, TokenEvent, WorkerLoad
from actors.ray_actors import PDDeployment
from cluster.router.choice import LocalPolicy
from cluster.router.client import Router
from cluster.router.config import RecoveryConfig, RouterConfig
from cluster.router.control import ControlPlane
from cluster.router.handles import WorkerGone, WorkerUnreachable

T = TypeVar("T")
_BACKGROUND: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks
DISCARD_TIMEOUT_S = 120.0


def drain_in_background(consume: Coroutine[Any, Any, None]) -> None:
    """Runs `consume` (reading an abandoned stream to its end) as a task the loop keeps, for at most
    `DISCARD_TIMEOUT_S`; its errors are dropped: only the stream's end matters."""
    async def bounded() -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(DISCARD_TIMEOUT_S):
                await consume

    task = asyncio.ensure_future(bounded())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


def named_failure(name: str, error: RayActorError) -> WorkerUnreachable:
    if isinstance(error, ActorDiedError):
        return WorkerGone(f"worker {name} is dead: {error}")
    return WorkerUnreachable(f"worker {name} did not answer: {error}")


async def _call(name: str, ref: Awaitable[T]) -> T:
    try:
        return await ref
    except RayActorError as e:
        raise named_failure(name, e) from e


class RayTokenStream:
    def __init__(self, name: str, refs: Any) -> None:
        self._name = name
        self._refs = refs

    def __aiter__(self) -> RayTokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        ref = await _call(self._name, self._refs.__anext__())
        return await _call(self._name, ref)

    def discard(self) -> None:
        async def consume() -> None:
            async for ref in self._refs:
                with contextlib.suppress(Exception):
                    await ref

        drain_in_background(consume())


class RayWorkerHandle:
    """A worker actor (`actors/ray_actors.py`) as a `WorkerHandle`."""

    def __init__(self, name: str, actor: ActorHandle) -> None:
        self.name = name
        self.actor = actor

    async def load(self) -> WorkerLoad:
        return await _call(self.name, self.actor.load.remote())

    async def telemetry(self, cursor: TelemetryCursor | None = None) -> Telemetry:
        return await _call(self.name, self.actor.telemetry.remote(cursor))

    async def announce(self, req: GenerationRequest) -> bool:
        return await _call(self.name, self.actor.announce.remote(req))

    async def prefill(self, req: GenerationRequest, decode: str) -> PrefillResult:
        return await _call(self.name, self.actor.prefill.remote(req, decode))

    def abort(self, request_id: str) -> Awaitable[Any]:
        return self.actor.abort.remote(request_id)

    def prefetch(self, req: GenerationRequest) -> Awaitable[Any]:
        return self.actor.prefetch.remote(req)

    def stream(self, req: GenerationRequest) -> RayTokenStream:
        return RayTokenStream(self.name, self.actor.generate.options(num_returns="streaming").remote(req))

    def stream_after_kv(self, request_id: str) -> RayTokenStream:
        return RayTokenStream(self.name,
                              self.actor.generate_after_kv.options(num_returns="streaming").remote(request_id))


def ray_handles(actors: dict[str, ActorHandle]) -> dict[str, RayWorkerHandle]:
    return {name: RayWorkerHandle(name, actor) for name, actor in actors.items()}


class RayReplacer:
    """The router's `Replacer` over a deployment's `replace(name) -> ActorHandle`
    (`actors.ray_actors.PDDeployment.replace`)."""

    def __init__(self, replace: Callable[[str], Awaitable[ActorHandle]]) -> None:
        self._replace = replace

    async def replace(self, name: str) -> RayWorkerHandle:
        return RayWorkerHandle(name, await self._replace(name))



def router_for(deployment: PDDeployment, cfg: RouterConfig | None = None, *, control: ControlPlane | None = None,
               policy: LocalPolicy | None = None, prefills: list[str] | None = None,
               recovery: RecoveryConfig | None = None, replace_dead: bool = False) -> Router:
    """A router over all of `deployment`'s workers, or over the named prefill workers only; with
    `replace_dead` it asks the deployment for a fresh worker whenever it declares one dead (give
    that to one router per deployment: two would each replace the same dead worker)."""
    chosen = {n: deployment.prefills[n] for n in prefills} if prefills is not None else deployment.prefills
    return Router(ray_handles(chosen), ray_handles(deployment.decodes), cfg, policy=policy, control=control,
                  recovery=recovery, replacer=RayReplacer(deployment.replace) if replace_dead else None)
