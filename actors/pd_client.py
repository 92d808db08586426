"""The caller that runs one request across the disaggregated workers (tests, bench, later the ingress).

Mental model, one `generate(req)`:
  loads (polled, cached for `load_ttl_s`, plus this client's own in-flight counts)
    -> placement (a replaceable policy) -> announce on the first decode worker that has room
    -> open the decode worker's token stream (a Ray streaming generator) -> prefill, which sends
       the KV straight to that decode worker -> yield `TokenEvent`s until the last one.
Every remote call is bounded (`asyncio.wait_for` on the awaited ref) and a miss becomes
`WorkerTimeout`; no room anywhere is `NoCapacity`. If anything fails, or the consumer stops early,
the decode worker is told to abort, which frees the request's blocks whatever state it is in.
Requests with nothing to hand over run on a decode worker alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from actors.errors import NoCapacity, WorkerTimeout
from actors.messages import GenerationRequest, PrefillResult, TokenEvent, WorkerLoad
from actors.placement import LeastLoaded, Placement
from actors.worker_config import ClientConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")
_RECENT = 4096  # prefill results kept for inspection


class PDClient:
    def __init__(self, prefills: Mapping[str, ActorHandle], decodes: Mapping[str, ActorHandle],
                 cfg: ClientConfig | None = None, placement: Placement | None = None) -> None:
        """`decodes` are keyed by the name the prefill workers know their endpoints by."""
        self.prefills = dict(prefills)
        self.decodes = dict(decodes)
        self.cfg = cfg or ClientConfig()
        self.placement = placement or LeastLoaded()
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._loads: dict[str, WorkerLoad] = {}
        self._loads_at = float("-inf")
        self._refresh: asyncio.Task[None] | None = None
        self._results: collections.OrderedDict[str, PrefillResult] = collections.OrderedDict()

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        loads = await self.loads()
        choice = self.placement.place(req, [loads[n] for n in self.prefills], [loads[n] for n in self.decodes])
        decode = choice.decodes[0] if choice.prefill is None else await self._announce(req, choice.decodes)
        self._in_flight[decode] += 1
        try:
            if choice.prefill is None:
                stream = self.decodes[decode].generate.options(num_returns="streaming").remote(req)
            else:
                stream = self.decodes[decode].generate_after_kv.options(num_returns="streaming").remote(req.request_id)
                try:
                    result = await self._bounded(self.prefills[choice.prefill].prefill.remote(req, decode),
                                                 self.cfg.prefill_timeout_s, f"prefill of {req.request_id}")
                except BaseException:
                    self.decodes[decode].abort.remote(req.request_id)  # frees the reservation at once
                    raise
                self._remember(result)
            # aclosing: a consumer that stops early closes _follow now, which aborts the request
            async with contextlib.aclosing(self._follow(decode, req.request_id, stream)) as events:
                async for event in events:
                    yield event
        finally:
            self._in_flight[decode] -= 1

    async def _announce(self, req: GenerationRequest, decodes: tuple[str, ...]) -> str:
        for name in decodes:
            try:
                if await self._bounded(self.decodes[name].announce.remote(req), self.cfg.call_timeout_s,
                                       f"announce of {req.request_id} on {name}"):
                    return name
            except (WorkerTimeout, RayActorError) as e:
                logger.warning("decode worker %s did not take %s: %s", name, req.request_id, e)
                self.decodes[name].abort.remote(req.request_id)  # in case it reserved after all
        raise NoCapacity(f"no decode worker has room for {req.request_id} now (asked {len(decodes)})")

    async def _follow(self, decode: str, request_id: str, stream: Any) -> AsyncIterator[TokenEvent]:
        """Yields the stream's events, each within `token_timeout_s`; aborts unless it finished."""
        finished = False
        try:
            while not finished:
                try:
                    ref = await asyncio.wait_for(stream.__anext__(), self.cfg.token_timeout_s)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise WorkerTimeout(f"{decode} sent nothing for {request_id} "
                                        f"in {self.cfg.token_timeout_s:g}s") from None
                event: TokenEvent = await ref
                finished = event.output.finished
                yield event
        finally:
            if not finished:
                self.decodes[decode].abort.remote(request_id)

    async def _bounded(self, ref: Awaitable[T], timeout_s: float, what: str) -> T:
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except asyncio.TimeoutError:
            raise WorkerTimeout(f"{what} did not answer within {timeout_s:g}s") from None

    # --------------------------------------------------------------------------------- loads
    async def loads(self) -> dict[str, WorkerLoad]:
        """Every worker's load, at most `load_ttl_s` old, with this client's in-flight requests
        counted in (a burst is placed before any worker reports it)."""
        if time.monotonic() - self._loads_at > self.cfg.load_ttl_s:
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.ensure_future(self._poll())
            await asyncio.shield(self._refresh)
        out = {}
        for name, load in self._loads.items():
            extra = self._in_flight[name] - load.num_active
            out[name] = replace(load, num_waiting=load.num_waiting + extra) if extra > 0 else load
        return out

    async def _poll(self) -> None:
        workers = {**self.prefills, **self.decodes}

        async def one(name: str, handle: ActorHandle) -> WorkerLoad:
            kind = "prefill" if name in self.prefills else "decode"
            try:
                load = await self._bounded(handle.load.remote(), self.cfg.call_timeout_s, f"load of {name}")
                return replace(load, name=name)  # our key is the name placement answers with
            except (WorkerTimeout, RayActorError) as e:
                logger.warning("worker %s is unhealthy: %s", name, e)
                return WorkerLoad(name, kind, 0, 0, 0, 0, 0, 0.0, healthy=False)

        loads = await asyncio.gather(*(one(n, h) for n, h in workers.items()))
        self._loads = {w.name: w for w in loads}
        self._loads_at = time.monotonic()

    def _remember(self, result: PrefillResult) -> None:
        self._results[result.request_id] = result
        while len(self._results) > _RECENT:
            self._results.popitem(last=False)

    def prefill_result(self, request_id: str) -> PrefillResult | None:
        """How a recent request was prefilled (reuse, bytes, stage times)."""
        return self._results.get(request_id)
