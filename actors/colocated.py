"""The colocated worker: prefill and decode of a request in one engine, the baseline of disaggregation.

Mental model: a thin shell over `AsyncEngine.generate` that speaks the data plane's messages
(`GenerationRequest` in, `TokenEvent`s out, `WorkerLoad` for the scheduler). It is what small
deployments run, what disaggregation has to beat on the same requests, and what a decode worker
uses for requests that need no handoff (1-token prompts, resumes from a journal).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from actors.engine.async_engine import AsyncEngine
from actors.messages import GenerationRequest, TokenEvent, WorkerKind, WorkerLoad
from actors.moe_handoff import apply_request_budget
from actors.telemetry import ReportsTelemetry


def read_load(async_engine: AsyncEngine, name: str, kind: WorkerKind, num_reserved: int = 0,
              shadow_bytes: int = 0) -> WorkerLoad:
    """A lock-free snapshot: never waits for a step (a scheduler polls it often), and may mix
    counters from just before and just after one; it only reads lengths and ints."""
    s = async_engine.engine.stats()
    return WorkerLoad(name=name, kind=kind, num_running=s.num_running, num_waiting=s.num_waiting,
                      num_reserved=num_reserved, num_free_blocks=s.num_blocks_free,
                      num_total_blocks=s.num_blocks_total, last_step_s=s.last_step_s,
                      healthy=async_engine.is_alive, rss_bytes=process_rss_bytes(), shadow_bytes=shadow_bytes,
                      kv_blocks_by_tenant=s.kv_blocks_by_tenant,
                      offloaded_bytes=s.offloaded_bytes, spec_method=s.spec_method,
                      num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
                      num_spec_rounds=s.num_spec_rounds, num_decode_rows=s.num_decode_rows, node=node_id())


_node_id = ""


def node_id() -> str:
    """The Ray node this process runs on ("" outside a Ray worker): where a worker's KV lives, so a
    transfer's node pair can be told. Asked of Ray once, when it answers."""
    global _node_id
    if not _node_id:
        try:
            import ray

            if ray.is_initialized():
                _node_id = ray.get_runtime_context().get_node_id() or ""
        except Exception:  # noqa: BLE001 - no Ray here, or not in a worker: unknown
            return ""
    return _node_id


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_rss_bytes() -> int:
    """Resident memory of this process (Linux `/proc/self/statm`, one read of a few bytes); 0 where
    there is no such file. Cheap enough for every load poll."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


class ColocatedWorker(ReportsTelemetry):
    def __init__(self, async_engine: AsyncEngine, name: str = "colocated") -> None:
        self.engine = async_engine
        self.name = name

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Streams the request's deltas; bad input raises before the first one. Closing the
        iterator early aborts the request and frees its blocks."""
        apply_request_budget(self.engine, req)  # its own expert budget, if any (MoE models)
        outputs = self.engine.generate(req.request_id, list(req.prompt_token_ids), req.params, req.engine_options())
        try:
            async for out in outputs:
                yield TokenEvent.of(out, self.name)
        finally:
            await outputs.aclose()  # runs the engine stream's abort-on-early-exit now, not at GC

    async def abort(self, request_id: str) -> bool:
        return await asyncio.to_thread(self.engine.abort, request_id)

    async def load(self) -> WorkerLoad:
        return read_load(self.engine, self.name, "colocated")

    def close(self) -> None:
        self.engine.shutdown()
