"""Running one request against a backend stream, and noticing when its client leaves.

Mental model: a backend stream is an async generator whose closing aborts the request and frees
its KV, so every path out of here closes it: normal end, error, client disconnect, cancellation.
- Non-streaming: the whole run is drained in a task raced against the client's `http.disconnect`;
  a disconnect cancels the task (the engine aborts the request) and the handler answers nobody.
- Streaming: the first output is awaited the same way *before* the response starts, so input the
  engine rejects (context, vocab, refusal) still gets a real 4xx status; the SSE body then yields
  the rest. `EventStream` closes the body generator in a `finally`, whatever ended the response:
  Starlette cancels it on disconnect, and an async generator left suspended at a `yield` would
  otherwise only be closed whenever the garbage collector gets to it.
Errors after the first chunk cannot change the status any more: they are sent in-band as one
`data: {"error": ...}` event (what OpenAI clients raise on), followed by `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Coroutine
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from actors.engine.output import RequestOutput
from actors.engine.sampling import TokenLogprobs
from deploy.openai.errors import internal_error, to_api_error
from deploy.openai.render import Renderer, usage_of

logger = logging.getLogger(__name__)

T = TypeVar("T")
Stream = AsyncGenerator[RequestOutput, None]


class ClientGone(Exception):
    """The client disconnected before its answer was ready; the request has been aborted."""


async def _disconnected(receive: Receive) -> None:
    # The body was already consumed, so the next message the server delivers is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # let its finally blocks (abort) run


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Runs `work`; if the client disconnects first, cancels it and raises ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _cancel(task)
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    await _cancel(task)
    raise ClientGone()


async def first_output(request: Request, stream: Stream) -> RequestOutput:
    async def first() -> RequestOutput:
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            raise RuntimeError("backend stream ended before its first output") from None

    try:
        return await until_disconnect(request, first())
    except BaseException:
        await stream.aclose()
        raise


async def run_to_end(request: Request, stream: Stream) -> tuple[RequestOutput, list[TokenLogprobs | None]]:
    async def drain() -> tuple[RequestOutput, list[TokenLogprobs | None]]:
        final: RequestOutput | None = None
        logprobs: list[TokenLogprobs | None] = []
        async with aclosing(stream):
            async for out in stream:
                logprobs.extend(out.logprobs)
                final = out
        if final is None or not final.finished:
            raise RuntimeError("backend stream ended without a finished output")
        return final, logprobs

    return await until_disconnect(request, drain())


def _event(payload: BaseModel | dict[str, Any]) -> bytes:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return b"data: " + data.encode() + b"\n\n"


async def sse_body(renderer: Renderer, first: RequestOutput, stream: Stream, *, include_usage: bool,
                   prompt_param: str) -> AsyncGenerator[bytes, None]:
    try:
        for chunk in renderer.opening():
            yield _event(chunk)
        out = first
        pending: list[TokenLogprobs | None] = []
        while True:
            # A token may add no text yet (half a character, a possible stop string): its logprobs
            # ride along with the next chunk that has text.
            pending.extend(out.logprobs)
            if out.new_text or out.finished:
                yield _event(renderer.chunk(out, pending))
                pending = []
            if out.finished:
                break
            out = await stream.__anext__()
        if include_usage:
            yield _event(renderer.usage_chunk(usage_of(out)))
        yield b"data: [DONE]\n\n"
    except Exception as e:
        err = to_api_error(e, prompt_param=prompt_param)
        if err is None:
            logger.exception("stream %s failed", renderer.request_id)
            err = internal_error(renderer.request_id)
        yield _event(err.body())
        yield b"data: [DONE]\n\n"
    finally:
        # GeneratorExit at a yield or CancelledError at an await: either way close the backend's
        # stream, which aborts the request (the backend must start that before its first await).
        await stream.aclose()


class EventStream(StreamingResponse):
    """Server-sent events whose body generator is always closed when the response ends."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncGenerator[bytes, None]) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:
            pass  # ASGI >= 2.4 servers report the disconnect by failing send(); nothing to answer
        finally:
            with anyio.CancelScope(shield=True):  # the abort must run even while being cancelled
                await self._body.aclose()

