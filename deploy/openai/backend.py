"""What the OpenAI HTTP app talks to: the `Backend` protocol and the colocated backend.

Mental model: the app owns HTTP (auth, validation, tokenizing, shaping responses); a backend owns
generation. The app hands it prompt token ids and validated `SamplingParams` and reads back the
engine's `RequestOutput` deltas. The same app serves the colocated `EngineBackend` below (one
in-process `AsyncEngine`, what tests use) and, later, a backend that asks the cluster scheduler for
a placement and streams tokens from a decode actor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any, Protocol, runtime_checkable

from actors.engine.async_engine import AsyncEngine
from actors.engine.options import RequestOptions
from actors.engine.output import RequestOutput
from actors.engine.sampling import SamplingParams
from actors.colocated import process_rss_bytes
from actors.engine.tokenizer import Tokenizer
from actors.messages import RequestPolicy, mib_or_none, spec_report, tenant_cache_salt
from actors.moe_handoff import budget_tracker
from deploy.openai.timeline import TimelineRecorder

logger = logging.getLogger(__name__)


@runtime_checkable
class Backend(Protocol):
    """Contract between the HTTP app and whatever generates tokens.

    - `model_name`, `max_model_len` (prompt + output tokens one request may hold) and `tokenizer`
      (chat templates, encoding prompts, token strings for logprobs) are fixed for its lifetime.
    - `generate(request_id, prompt_token_ids, params, policy=...)` is an async generator of
      `RequestOutput` deltas ending with one whose `finished` is true. Everything wrong with the
      request (the `actors.engine.errors.InvalidRequest` family) and refusals are
      raised at the first `__anext__`, before any output (a refusal is `actors.errors.Refused`). Closing the generator early (`aclose`,
      or cancelling the task iterating it) aborts the request and frees its KV everywhere; the
      abort must be set going before the generator's cleanup first awaits, because a cancelled
      caller (anyio cancels level-triggered) may not let a later await finish. The `policy`
      (`actors.messages.RequestPolicy`, resolved by the Gate) names the tenant, which decides cache
      isolation and budgets, and the caller's and tenant's say on SLO class, speculation, expert
      budget and KV recovery; request ids are unique (the app makes them). A backend that knows
      its model's experts per layer says so as `num_experts` (0: dense).
    - `health()` returns a JSON-able dict with `"healthy": bool` and any detail; raising or
      taking longer than the app's deadline counts as unhealthy.
    - Optional `timeline(request_id) -> dict | None`: the token-level latency breakdown of a
      recent request, carrying its owner under `"tenant"` (the app shows it to that tenant only);
      None when unknown.
    """

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 policy: RequestPolicy) -> AsyncGenerator[RequestOutput, None]: ...

    async def health(self) -> dict[str, Any]: ...


_BACKGROUND: set[asyncio.Task[Any]] = set()  # the loop keeps only weak references to tasks


def _detached(work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """Starts `work` as its own task: it runs to the end even if the caller is cancelled."""
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


class EngineBackend:
    """The colocated backend: one `AsyncEngine` in this process, tenants isolated by cache salt."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, *, timeline_capacity: int = 1024) -> None:
        self.async_engine = async_engine
        self._model_name = model_name
        self.timelines = TimelineRecorder(timeline_capacity)

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self.async_engine.engine.max_model_len

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (0: a dense model): the bound of `x-ferry-expert-budget`."""
        return self.async_engine.engine.model_config.num_experts

    @property
    def tokenizer(self) -> Tokenizer:
        return self.async_engine.engine.tokenizer

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       policy: RequestPolicy) -> AsyncGenerator[RequestOutput, None]:
        tenant = policy.tenant
        trace = self.timelines.open(request_id, tenant)
        budget = policy.expert_budget  # the caller's x-ferry-expert-budget (MoE models)
        tracker = None if budget is None else budget_tracker(self.async_engine.engine)
        if tracker is not None:
            tracker.set_request_budget(request_id, budget)
        stream: AsyncIterator[RequestOutput] = self.async_engine.generate(
            request_id, prompt_token_ids, params, RequestOptions(extra_keys=tenant_cache_salt(tenant), tenant=tenant,
                                                                 speculation=policy.speculation))
        started = finished = False
        try:
            async for out in stream:
                started, finished = True, out.finished
                trace.on_output(out)
                yield out
        finally:
            # Reached through aclose() and cancellation too, and must free the request's blocks
            # in every case. Closing the engine's stream is meant to abort, but cannot be relied
            # on alone: a stream that delegates to an inner generator aborts only once that one
            # is garbage-collected, and under anyio's level-triggered cancellation (Starlette
            # cancels a streaming response's task group on disconnect) every await in a finally
            # is cancelled again. So the abort starts here, before any await, as a task of its
            # own; aborting a finished or unknown request is a no-op.
            abort = None if finished else _detached(asyncio.to_thread(self.async_engine.abort, request_id))
            if not started:
                self.timelines.discard(request_id)  # refused or cancelled before any output
                if tracker is not None:  # a budget no step may ever carry (and so drop)
                    tracker.set_request_budget(request_id, None)
            elif not finished:
                trace.finish_reason = "abort"
            try:
                await stream.aclose()  # type: ignore[attr-defined]
            finally:
                if abort is not None:
                    await asyncio.shield(abort)

    async def health(self) -> dict[str, Any]:
        engine = self.async_engine
        # AsyncEngine keeps its loop state private; these two say whether it still steps.
        error = getattr(engine, "_error", None)
        thread = getattr(engine, "_thread", None)
        alive = thread is not None and thread.is_alive()
        stats = await asyncio.to_thread(engine.stats)  # takes the engine lock: waits <= one step
        return {
            "healthy": error is None and alive,
            "model": self._model_name,
            "engine_loop": "failed" if error is not None else ("running" if alive else "stopped"),
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_blocks_total": stats.num_blocks_total,
            "num_blocks_free": stats.num_blocks_free,
            "rss_mib": mib_or_none(process_rss_bytes()),  # this process: the engine runs in it
            "kv_plan": engine.engine.kv_plan.to_dict(),  # how the KV pool was sized (fixed at start)
            "speculation": spec_report(stats.spec_method, stats.num_draft_tokens, stats.num_accepted_tokens,
                                       stats.num_spec_rounds),
        }

    def timeline(self, request_id: str) -> dict[str, Any] | None:
        return self.timelines.get(request_id)
