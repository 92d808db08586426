"""Reading one attempt's token stream with deadlines (`follow`), used by the router's `_attempt`.

Mental model: every event must come within `token_timeout_s` of the last one, or the attempt fails
as `WorkerTimeout` (the router then probes the worker and recovers the request elsewhere). One
wait is not a fault: a request run whole on a worker (a local prefill, a resume that recomputes)
first queues in that worker's engine until a row frees. So before the first event, a deadline
that passes while the worker answers its load call healthy with requests waiting for a row is
extended, up to `row_wait_s` more in all; a worker that does not answer, reports itself unhealthy
or has no queue fails the attempt as before. The read in progress is never cancelled by a deadline
(cancelling a stream's pending read may close the stream): it is awaited again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from actors.errors import WorkerTimeout
from actors.messages import TokenEvent
from cluster.router.handles import TokenStream, WorkerHandle, WorkerUnreachable
from cluster.router.loads import bounded

logger = logging.getLogger(__name__)


async def follow(worker: WorkerHandle, request_id: str, stream: TokenStream, *, token_timeout_s: float,
                 row_wait_s: float, probe_timeout_s: float) -> AsyncIterator[TokenEvent]:
    """Yields the stream's events, each within `token_timeout_s` (the first one also while it
    queues for a row, see above); aborts the request on the worker unless it finished."""
    finished, first = False, True
    row_deadline = time.monotonic() + token_timeout_s + row_wait_s
    pending: asyncio.Future[TokenEvent] | None = None
    try:
        while not finished:
            if pending is None:
                pending = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=token_timeout_s)
            if not done:
                if first and time.monotonic() < row_deadline and await _queued(worker, probe_timeout_s):
                    logger.info("%s: no token from %s in %gs; it waits there for a row", request_id, worker.name,
                                token_timeout_s)
                    continue
                raise WorkerTimeout(f"{worker.name} sent nothing for {request_id} in {token_timeout_s:g}s")
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            first = False
            finished = event.output.finished
            yield event
    finally:
        if pending is not None:
            pending.cancel()
        if not finished:
            worker.abort(request_id)
            stream.discard()  # its last event carries the abort's error: consumed, not surfaced


async def _queued(worker: WorkerHandle, timeout_s: float) -> bool:
    """Whether `worker` answers healthy with requests waiting for a row in its engine."""
    with contextlib.suppress(WorkerUnreachable, WorkerTimeout):
        load = await bounded(worker.load(), timeout_s, f"load of {worker.name}")
        return load.healthy and load.num_waiting > 0
    return False
