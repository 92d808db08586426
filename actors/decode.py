"""The decode worker: takes a request's KV from a prefill worker, joins it to its running batch, streams.

Mental model, one request:
  1. `announce(req)` reserves blocks for the prompt's first `len(prompt) - 1` tokens (the last one is
     recomputed by the first decode step, which samples the first output token: all sampling,
     text and stop logic happen here), opens the request's output stream and starts a lease.
     False means "no room now": the caller tries another decode worker.
  2. The caller has a prefill worker send the KV to `transport_metadata()`'s endpoint; the
     `KVReceiver` writes each shard as it lands and commits the request after the last one.
     An MoE request with an expert budget gets its prompt's expert choice from the prefill worker
     just before its KV (`moe_handoff.py`); the receiver gives it to the engine before the commit.
  3. `generate_after_kv(request_id)` streams `TokenEvent`s (ids, text deltas, wall-clock time).
A lease that passes first frees the blocks and fails the stream with `KVNotArrived`. Requests with
nothing to hand over (1-token prompts, resumes) run whole here through `generate(req)`.

Every method that may wait for the engine lock (up to one step) runs off the event loop, so the
streams of other requests keep flowing while an announce waits.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from actors.colocated import read_load
from actors.engine.async_engine import AsyncEngine
from actors.engine.engine import Engine
from actors.engine.output import RequestOutput
from actors.errors import RequestAborted, UnknownRequest
from actors.kv_shadow import ShadowStats
from actors.kv_receiver import KVReceiver, ReceiverStats
from actors.messages import GenerationRequest, TokenEvent, WorkerLoad
from actors.moe_handoff import apply_request_budget
from actors.pool_link import PoolLink, PoolLinkStats
from actors.prefix_cache.pool import PrefixCachePool
from actors.telemetry import ReportsTelemetry
from actors.whole_runs import WholeRuns
from actors.worker_config import WorkerConfig
from transfer.codec import KVLayout
from transfer.transport import KVTransport

logger = logging.getLogger(__name__)

_Queue = asyncio.Queue[RequestOutput | BaseException]


class DecodeWorker(ReportsTelemetry):
    def __init__(self, cfg: WorkerConfig, async_engine: AsyncEngine, transport: KVTransport, layout: KVLayout,
                 name: str | None = None, prefix_pool: PrefixCachePool | None = None) -> None:
        self.cfg = cfg
        self.engine = async_engine
        self.transport = transport
        self.layout = layout
        self.name = name or transport.name
        self.receiver = KVReceiver(async_engine, transport, layout, cfg.recv_poll_s)
        # Requests it runs whole (1-token prompts, its own prefills, resumes), and the KV shadows
        # of every request with a shadow salt (`whole_runs.py`, `kv_shadow.py`).
        pool = PoolLink(prefix_pool, layout, cfg.pool_codec_for, cfg.max_pending_offers, exact_for=cfg.exact_kv) if prefix_pool else None
        self.runs = WholeRuns(async_engine, self.name, layout.block_size, pool, cfg.max_shadow_bytes, cfg.shadow_keep_s)
        self.pool, self.shadows = pool, self.runs.shadows
        # Streams opened by announce and not yet attached by generate_after_kv, with the time by
        # which a caller must attach (a caller that vanished must not leave its queue behind).
        self._streams: dict[str, tuple[_Queue, float]] = {}
        self._streams_lock = threading.Lock()

    # ------------------------------------------------------------------------------ handoff
    async def announce(self, req: GenerationRequest) -> bool:
        """Reserves room for the request's KV; False when there is none now. Bad input raises."""
        if not req.needs_handoff:
            raise ValueError(f"{req.request_id}: nothing to hand over; run it with generate()")
        loop = asyncio.get_running_loop()
        return await asyncio.to_thread(self._reserve, req, loop)

    def _reserve(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop) -> bool:
        self._sweep_unattached(time.monotonic())
        prompt = list(req.prompt_token_ids)
        engine: Engine = self.engine.engine
        args = (engine.reserve, req.request_id, prompt, req.params, req.engine_options())
        block_ids = self.engine.locked(*args, num_kv_tokens=len(prompt) - 1)
        if block_ids is None and self.engine.locked(engine.scheduler.may_yield_to, req.priority_rank, req.tenant):
            # The room is a running batch request's (its KV can go to host memory), but not while
            # a forward still writes its blocks: once more, between two steps.
            block_ids = self.engine.between_steps(*args, num_kv_tokens=len(prompt) - 1)
        if block_ids is None:
            return False
        apply_request_budget(self.engine, req)  # its expert choice comes with the KV (`moe_handoff.py`)
        if self.shadows is not None:
            self.shadows.track(req.request_id, req)
        # The stream exists before the KV can land, so no output of the commit is missed.
        queue = self.engine.open_stream(req.request_id, loop)
        with self._streams_lock:
            self._streams[req.request_id] = (queue, time.monotonic() + self.cfg.lease_s + self.cfg.transfer_timeout_s)
        self.receiver.expect(req.request_id, block_ids, self.cfg.lease_s)
        return True

    async def generate_after_kv(self, request_id: str) -> AsyncIterator[TokenEvent]:
        """The stream of an announced request; fails with `KVNotArrived` if its lease expires."""
        with self._streams_lock:
            entry = self._streams.pop(request_id, None)
        if entry is None:
            raise UnknownRequest(f"{request_id} was not announced here, or its stream is taken or expired")
        finished = False
        try:
            async for out in self.engine.stream(request_id, entry[0]):
                finished = out.finished
                yield TokenEvent.of(out, self.name)
        finally:
            if not finished:  # the consumer went away: a reservation still waiting for KV is freed too
                asyncio.get_running_loop().run_in_executor(
                    None, self.receiver.cancel, request_id, RequestAborted(f"{request_id}: stream closed"))

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Runs a request entirely here (`WholeRuns`): one with nothing to hand over (1-token
        prompt), one the scheduler has this worker prefill itself (the prefix-cache pool's blocks
        of its prompt imported first), or a resume (from its KV shadows when the pool has them)."""
        async for event in self.runs.generate(req):
            yield event

    def shadow_stats(self) -> ShadowStats | None:
        """KV shadowing of this worker's requests (None without a pool)."""
        return self.runs.shadow_stats()

    def pool_stats(self) -> PoolLinkStats | None:
        """Blocks fetched from the pool for prompts prefilled here (None without a pool)."""
        return None if self.pool is None else self.pool.stats()

    async def abort(self, request_id: str) -> bool:
        """Drops the request wherever it is: pending KV (blocks freed), running, or finished."""
        return await asyncio.to_thread(self._abort, request_id)

    def _abort(self, request_id: str) -> bool:
        # An unattached stream keeps its queue, now holding the error, for a caller that attaches
        # late; the sweep drops it at its deadline.
        error = RequestAborted(f"{request_id} was aborted")
        if self.receiver.cancel(request_id, error):
            return True
        # Committed: end its stream (a consumer waiting on it sees the error), then free its blocks.
        self.engine.fail_stream(request_id, error)
        return self.engine.abort(request_id)

    def _sweep_unattached(self, now: float) -> None:
        with self._streams_lock:
            stale = [r for r, (_, deadline) in self._streams.items() if deadline <= now]
            for request_id in stale:
                del self._streams[request_id]
        for request_id in stale:
            logger.info("%s: nobody attached to the stream of %s in time; dropping it", self.name, request_id)
            self._abort(request_id)

    # ------------------------------------------------------------------------ introspection
    async def load(self) -> WorkerLoad:
        load = read_load(self.engine, self.name, "decode", self.receiver.num_pending, self.runs.shadow_bytes)
        return load if self.pool is None else replace(load, pool_fetch_s_per_block=self.pool.fetch_s_per_block)

    def receiver_stats(self) -> ReceiverStats:
        return self.receiver.stats()

    def transport_metadata(self) -> bytes:
        return self.transport.metadata()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.receiver.close()
        self.transport.close()
        self.engine.shutdown()
