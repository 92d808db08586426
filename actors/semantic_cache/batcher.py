"""`LookupBatcher`: concurrent callers' queries gathered into one batched call on a thread.

Mental model: each caller `submit`s one query and awaits its own result. The first query into an
idle batcher starts a flush loop on the event loop: wait `window_s` for company, take everything
pending, run it as one `run(batch)` in a thread (one embedding forward for the whole batch), hand
each caller its result, and repeat while queries are pending. Whatever arrives while a batch runs
forms the next batch, so under load a batch holds everything that queued behind the previous
forward, and at most one batch runs at a time. A batch that raises fails its own callers only; a
caller cancelled meanwhile is skipped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

Q = TypeVar("Q")
R = TypeVar("R")


class LookupBatcher(Generic[Q, R]):
    def __init__(self, run: Callable[[list[Q]], list[R]], window_s: float) -> None:
        assert window_s >= 0, window_s
        self._run = run
        self._window_s = window_s
        self._pending: list[tuple[Q, asyncio.Future[R]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, query: Q) -> R:
        """The result of `query` once its batch has run; raises what the batch raised."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((query, future))
        if self._flusher is None:
            self._flusher = asyncio.ensure_future(self._flush())
        return await future

    async def submit_many(self, queries: list[Q]) -> list[R]:
        """Every query of one caller, batched with everyone else's; results in order."""
        return list(await asyncio.gather(*(self.submit(q) for q in queries)))

    async def _flush(self) -> None:
        try:
            while self._pending:
                await asyncio.sleep(self._window_s)
                batch, self._pending = self._pending, []
                await self._run_batch(batch)
        finally:
            self._flusher = None  # no await between the empty check and here: no query is stranded

    async def _run_batch(self, batch: list[tuple[Q, asyncio.Future[R]]]) -> None:
        try:
            results: list[R] | None = await asyncio.to_thread(self._run, [q for q, _ in batch])
            error = None
        except Exception as e:
            results, error = None, e
        for i, (_, future) in enumerate(batch):
            if future.done():
                continue  # its caller was cancelled meanwhile
            if results is None:
                future.set_exception(error)  # type: ignore[arg-type]
            else:
                future.set_result(results[i])
