"""asyncio front of the engine: one background thread steps the engine, callers await streams.

The engine is single-threaded; a lock serialises `add_request`/`abort` (called from the event loop
through `asyncio.to_thread`) with `step` (called from the stepping thread), so a new request waits at
most one step to enter. Each request's outputs go to its own asyncio queue via
`call_soon_threadsafe`. A consumer that stops iterating (client gone, task cancelled) aborts its
request, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from actors.engine.engine import Engine
from actors.errors import EngineDead, NoCapacity
from actors.engine.options import RequestOptions
from actors.engine.output import RequestOutput
from actors.engine.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 30.0  # an idle engine loop's longest sleep: work wakes it at once, this is only a backstop


class EngineDeadSignal(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(repr(error))
        self.error = error


T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: Engine, *, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.engine = engine
        # A stream's deltas carry at least this many tokens (its first and last excepted); a delta
        # also takes what else is already queued (up to the last output with text, see
        # `_mergeable_prefix`), so a slow consumer does not fall behind one message per token.
        self.stream_interval = stream_interval
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        # `between_steps`: callers that must not overlap a forward (it may take a running request's
        # blocks) wait for the step in flight to finish; the loop holds the next one for them.
        self._step_done = threading.Condition(self._lock)
        self._forward_running = False
        self._num_between = 0
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]] = {}
        self._stopped = False
        self._error: BaseException | None = None
        # Called after each step, engine lock held, with the step's outputs (KV shadowing): a hook
        # that raises is logged, never allowed to stop the engine.
        self.after_step: list[Callable[[Engine, list[RequestOutput]], None]] = []
        # Called before each step, engine lock held: seconds to wait before it (a decode engine
        # lending the node's cores to a prefill: actors/core_share.py); 0 steps at once. A hook
        # that raises is logged and removed.
        self.pause_before_step: Callable[[Engine], float] | None = None
        self._thread = threading.Thread(target=self._loop, name="ferry-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        options: RequestOptions | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs until it finishes. Bad input raises before the first
        yield. `params` and `options` go to `Engine.add_request`."""
        async for out in self._run(request_id, self.engine.add_request, request_id, prompt, params, options):
            yield out

    async def resume(self, request_id: str, prompt: list[int], params: SamplingParams, kv: "torch.Tensor",
                     options: RequestOptions, num_kv_tokens: int | None = None) -> AsyncIterator[RequestOutput]:
        """`generate` for a request resumed from its saved KV (`Engine.resume_from_kv`); raises
        `NoCapacity` before the first yield when the engine has no room for it now."""
        def add(*args: Any) -> None:
            if not self.engine.resume_from_kv(*args):
                raise NoCapacity(f"no room to resume {request_id} here now")

        async for out in self._run(request_id, add, request_id, prompt, params, kv, options, num_kv_tokens):
            yield out

    async def _run(self, request_id: str, add_fn: Callable[..., Any], *args: Any) -> AsyncIterator[RequestOutput]:
        self._check_alive()
        loop = asyncio.get_running_loop()

        def add() -> asyncio.Queue[RequestOutput | BaseException]:
            with self._lock:
                add_fn(*args)
                return self._open(request_id, loop)

        try:
            queue = await asyncio.to_thread(add)
        except asyncio.CancelledError:
            self._abort_soon(request_id)  # the thread may still add it after we were cancelled
            raise
        self._wakeup.set()
        async with contextlib.aclosing(self._drain(request_id, queue)) as outputs:
            async for out in outputs:
                yield out

    def open_stream(self, request_id: str, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[RequestOutput | BaseException]:
        """Registers where a request's outputs go before it exists in the engine (a reserved
        handoff that is committed later). Pair with `stream`."""
        with self._lock:
            return self._open(request_id, loop)

    async def stream(self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]) -> AsyncIterator[RequestOutput]:
        async with contextlib.aclosing(self._drain(request_id, queue)) as outputs:
            async for out in outputs:
                yield out

    def fail_stream(self, request_id: str, error: BaseException) -> None:
        """Ends a stream with an error (e.g. its KV never arrived)."""
        with self._lock:
            target = self._queues.pop(request_id, None)
        if target is not None:
            target[0].call_soon_threadsafe(target[1].put_nowait, error)

    def locked(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs `fn` on the engine between steps (e.g. reserve, write_blocks, commit)."""
        with self._lock:
            result = fn(*args, **kwargs)
        self._wakeup.set()
        return result

    def between_steps(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`locked`, but also with no forward pass running: waits for the step in flight (at most
        one), and the next waits for `fn`. For calls that may take a running request's blocks (a
        reservation offloading a batch request's KV), which a forward in flight still writes."""
        with self._lock:
            self._num_between += 1
            try:
                self._step_done.wait_for(lambda: not self._forward_running or self._error is not None)
                self._check_alive()
                return fn(*args, **kwargs)
            finally:
                self._num_between -= 1
                self._step_done.notify_all()
                self._wakeup.set()

    def _open(self, request_id: str, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[RequestOutput | BaseException]:
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = (loop, queue)
        return queue

    async def _drain(self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]) -> AsyncIterator[RequestOutput]:
        finished = started = False
        pending: list[RequestOutput] = []  # taken from the queue, not yet sent
        try:
            while True:
                item = await queue.get()
                while True:
                    if isinstance(item, EngineDeadSignal):
                        raise EngineDead("engine loop failed") from item.error
                    if isinstance(item, BaseException):
                        raise item
                    pending.append(item)
                    if item.finished or queue.empty():
                        break
                    item = queue.get_nowait()
                while pending:
                    cut = _mergeable_prefix(pending)
                    delta = functools.reduce(RequestOutput.followed_by, pending[:cut])
                    # The first delta goes at once (time to first token); later ones once they
                    # carry `stream_interval` tokens; the last one whatever it holds.
                    if started and not delta.finished and len(delta.new_token_ids) < self.stream_interval:
                        break
                    del pending[:cut]
                    started, finished = True, delta.finished
                    yield delta
                if finished:
                    return
        finally:
            if not finished:
                self._abort_soon(request_id)

    def _run_hooks(self, outputs: list[RequestOutput]) -> None:
        for hook in self.after_step:
            try:
                hook(self.engine, outputs)
            except Exception:  # noqa: BLE001 - a helper's bug must not kill every stream
                logger.exception("after-step hook %r failed", hook)

    def _abort_soon(self, request_id: str) -> None:
        # Not awaited on purpose: a cancelled consumer (client gone) may be cancelled again inside
        # its cleanup, and the abort must happen anyway. The executor runs it whatever we do next.
        asyncio.get_running_loop().run_in_executor(None, self.abort, request_id)

    @property
    def is_alive(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDead("engine loop failed") from self._error

    def abort(self, request_id: str) -> bool:
        with self._lock:
            self._queues.pop(request_id, None)
            found = self.engine.abort(request_id) is not None
        self._wakeup.set()  # its freed blocks may let a waiting request in
        return found

    def stats(self):  # type: ignore[no-untyped-def]
        with self._lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    def _pause(self) -> float:
        hook = self.pause_before_step
        if hook is None:
            return 0.0
        try:
            with self._lock:
                return hook(self.engine)
        except Exception:  # noqa: BLE001 - lending cores is an optimisation: never stop the engine for it
            logger.exception("pause_before_step failed; the engine steps without it from now on")
            self.pause_before_step = None
            return 0.0

    def _loop(self) -> None:
        while not self._stopped:
            wait = self._pause()
            if wait > 0:
                time.sleep(wait)
                continue
            try:
                # The forward pass runs outside the lock, so adds, aborts and KV handoffs wait for
                # bookkeeping only, never for a whole step.
                with self._lock:
                    self._step_done.wait_for(lambda: self._num_between == 0)
                    # Cleared before looking for work, under the lock every add takes: a wake-up
                    # set after this is kept for the wait below, so an idle wait can never miss one.
                    self._wakeup.clear()
                    prepared = self.engine.prepare_step()
                    self._forward_running = busy = prepared is not None
                if busy:
                    logits = self.engine.execute(prepared)
                    with self._lock:
                        outputs = self.engine.finish_step(prepared, logits)
                        self._forward_running = False
                        self._step_done.notify_all()
                        self._run_hooks(outputs)
            except BaseException as e:  # noqa: BLE001 - fail every stream, not silently
                logger.exception("engine step failed")
                with self._lock:
                    self._error = e
                    self._step_done.notify_all()
                    for loop, queue in self._queues.values():
                        loop.call_soon_threadsafe(queue.put_nowait, EngineDeadSignal(e))
                    self._queues.clear()
                return
            if busy:
                # One wake-up per event loop per step, not one per output: each costs the loop a
                # self-pipe write and a turn. Scheduled under the lock, as `fail_stream` schedules
                # its error, so a stream's outputs and its error arrive in the order they happened.
                batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
                with self._lock:
                    for out in outputs:
                        target = self._queues.get(out.request_id)
                        if target is None:
                            continue
                        if out.finished:
                            del self._queues[out.request_id]
                        batches.setdefault(target[0], []).append((target[1], out))
                    for loop, batch in batches.items():
                        loop.call_soon_threadsafe(_deliver, batch)
            if not busy:
                # Idle means idle: every change that can make work (an add, a commit, a
                # `locked`/`between_steps` call, shutdown) sets `_wakeup`; the timeout is a backstop only.
                self._wakeup.wait(timeout=IDLE_WAIT_S)


def _deliver(batch: list[tuple[asyncio.Queue[Any], RequestOutput]]) -> None:
    for queue, out in batch:
        queue.put_nowait(out)


def _mergeable_prefix(outputs: list[RequestOutput]) -> int:
    """How many leading outputs may go out as one delta: up to the last that carries text (or
    finishes). Tokens whose text the detokenizer still holds back must not ride behind text in one
    delta: a reader (the recovery journal) counts a delta with text as covering all its tokens.
    Outputs that all lack text merge freely."""
    for i in range(len(outputs) - 1, -1, -1):
        if outputs[i].new_text or outputs[i].finished:
            return i + 1
    return len(outputs)
