"""How the router reaches a worker: the `WorkerHandle` protocol, and its in-process implementation.

Mental model: the router never touches Ray. It calls workers through `WorkerHandle`s, whose every
method is a coroutine (or starts a call at once and returns something awaitable) and whose
failures are named: `WorkerGone` (the worker's process is dead for good), `WorkerUnreachable` (a
call could not reach it: restarting, overloaded, a network fault). The data plane's own failures
(`actors.errors`: no room, KV not arrived, ...) pass through unchanged. A stream
(`TokenStream`) starts when it is opened, not when it is first read: the router opens a decode
worker's stream before it asks the prefill worker for the KV, so the decode side is listening
when it lands.

Implementations: `RayWorkerHandle` (cluster/router/ray_handles.py) over an actor handle, and
`LocalWorkerHandle` here over a worker object in this process (tests, and a single-process
server), which can also be `kill`ed to play a dead worker. `start_prefetch` is the router's
fire-and-forget use of a prefill worker's `prefetch` while a request waits for a decode row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any, Protocol

from actors.errors import DataPlaneError
from actors.messages import GenerationRequest, PrefillResult, Telemetry, TelemetryCursor, TokenEvent, WorkerLoad

logger = logging.getLogger(__name__)


class WorkerUnreachable(DataPlaneError):
    """A call did not reach the worker, or its answer did not come back (restarting, overloaded,
    a network fault); the worker may still be alive."""


class WorkerGone(WorkerUnreachable):
    """The worker's process is dead and will not come back under this handle."""


class TokenStream(Protocol):
    """A decode worker's events for one request, already started."""

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...

    async def __anext__(self) -> TokenEvent: ...

    def discard(self) -> None:
        """Stops reading: whatever is left is consumed in the background, never surfaced."""
        ...


class WorkerHandle(Protocol):
    """One worker as the router calls it. Prefill workers answer `prefill`; decode workers
    `announce`, `stream`, `stream_after_kv` and `abort`; both `load` and `telemetry`."""

    name: str

    async def load(self) -> WorkerLoad: ...

    async def telemetry(self, cursor: TelemetryCursor | None = None) -> Telemetry: ...

    async def announce(self, req: GenerationRequest) -> bool:
        """Reserves room for `req`'s KV; False: no room now."""
        ...

    async def prefill(self, req: GenerationRequest, decode: str) -> PrefillResult:
        """Computes `req`'s KV and sends it to decode worker `decode`."""
        ...

    def abort(self, request_id: str) -> Awaitable[Any]:
        """Sent at once; awaiting the result is optional (its errors are the caller's to ignore)."""
        ...

    def prefetch(self, req: GenerationRequest) -> Awaitable[Any]:
        """A prefill worker brings `req`'s cached prefix up from the pool's disk tier while `req`
        waits; sent at once, like `abort`."""
        ...

    def stream(self, req: GenerationRequest) -> TokenStream:
        """Runs `req` whole on this worker (prefill included)."""
        ...

    def stream_after_kv(self, request_id: str) -> TokenStream:
        """Decodes an announced request once its KV has landed."""
        ...


_PREFETCHES: set[asyncio.Future[Any]] = set()  # the loop keeps only weak references to tasks


def start_prefetch(prefills: Mapping[str, WorkerHandle], name: str | None, req: GenerationRequest) -> None:
    """Has prefill worker `name` prefetch `req`'s prefix (`WorkerHandle.prefetch`) without waiting:
    a prefetch only saves time, so whatever goes wrong with it is logged and forgotten."""
    worker = prefills.get(name) if name is not None else None
    if worker is None:
        return

    def done(pending: asyncio.Future[Any]) -> None:
        _PREFETCHES.discard(pending)
        if not pending.cancelled() and pending.exception() is not None:
            logger.info("prefetch of %s on %s failed: %r", req.request_id, worker.name, pending.exception())

    try:
        pending = asyncio.ensure_future(worker.prefetch(req))
    except Exception as e:  # noqa: BLE001 - a dead worker: the prefill call will find out
        logger.info("prefetch of %s on %s not sent: %r", req.request_id, worker.name, e)
        return
    _PREFETCHES.add(pending)
    pending.add_done_callback(done)


class _LocalStream:
    """A worker's async generator, run by a task from the moment it is opened."""

    def __init__(self, events: AsyncIterator[TokenEvent], gone: asyncio.Event) -> None:
        self._queue: asyncio.Queue[TokenEvent | BaseException | None] = asyncio.Queue()
        self._gone = gone
        self._task = asyncio.ensure_future(self._pump(events))

    async def _pump(self, events: AsyncIterator[TokenEvent]) -> None:
        try:
            async for event in events:
                await self._queue.put(event)
            await self._queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            await self._queue.put(e)
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]

    def __aiter__(self) -> _LocalStream:
        return self

    async def __anext__(self) -> TokenEvent:
        get = asyncio.ensure_future(self._queue.get())
        gone = asyncio.ensure_future(self._gone.wait())
        try:
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not get.done():
            get.cancel()
            raise WorkerGone("the worker died while streaming")
        item = get.result()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def discard(self) -> None:
        self._task.cancel()


class LocalWorkerHandle:
    """A worker object of this process (`PrefillWorker`, `DecodeWorker`, `ColocatedWorker`) behind
    the `WorkerHandle` protocol. `kill()` makes it behave like a dead actor: every call and every
    open stream fails with `WorkerGone`."""

    def __init__(self, name: str, worker: Any) -> None:
        self.name = name
        self.worker = worker
        self._gone = asyncio.Event()

    def kill(self) -> None:
        self._gone.set()

    def _check(self) -> None:
        if self._gone.is_set():
            raise WorkerGone(f"worker {self.name} is dead")

    async def load(self) -> WorkerLoad:
        self._check()
        return await self.worker.load()

    async def telemetry(self, cursor: TelemetryCursor | None = None) -> Telemetry:
        self._check()
        return await self.worker.telemetry(cursor)

    async def announce(self, req: GenerationRequest) -> bool:
        self._check()
        return await self.worker.announce(req)

    async def prefill(self, req: GenerationRequest, decode: str) -> PrefillResult:
        self._check()
        return await self.worker.prefill(req, decode)

    def abort(self, request_id: str) -> Awaitable[Any]:
        if self._gone.is_set():  # a dead worker holds nothing: as Ray's abort to a dead actor, it does nothing
            done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            done.set_result(False)
            return done
        return asyncio.ensure_future(self.worker.abort(request_id))

    def prefetch(self, req: GenerationRequest) -> Awaitable[Any]:
        self._check()
        return asyncio.ensure_future(self.worker.prefetch(req))

    def stream(self, req: GenerationRequest) -> TokenStream:
        self._check()
        return _LocalStream(self.worker.generate(req), self._gone)

    def stream_after_kv(self, request_id: str) -> TokenStream:
        self._check()
        return _LocalStream(self.worker.generate_after_kv(request_id), self._gone)
