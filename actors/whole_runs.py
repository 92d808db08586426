"""A worker's runs of whole requests, with nothing handed over: fresh prompts and resumes.

Mental model: a request runs whole on one engine when there is no KV to hand over (a 1-token
prompt), when the scheduler has a decode worker prefill for itself, and when a request resumes
after its worker died or its row was preempted. A resume starts from the request's KV shadows
when the pool holds them (`kv_shadow.py`: only the tail is computed, the output is the same as
without the interruption); otherwise, like a fresh prompt, it first imports what the prefix pool
holds of its prompt (fresh prompts only) and computes the rest. Every request with a shadow salt
that runs here is shadowed from then on, so a second failure resumes from KV too.

Decode workers run these, and so does a prefill worker lent to a dead decode worker's streams
while its replacement starts (the router's choice).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from actors.colocated import ColocatedWorker
from actors.engine.async_engine import AsyncEngine
from actors.handoff import num_reusable_blocks, prompt_block_hashes
from actors.kv_shadow import KVShadows, Resume, ShadowStats
from actors.messages import GenerationRequest, TokenEvent
from actors.moe_handoff import apply_request_budget
from actors.pool_link import PoolLink, import_prefix


class WholeRuns:
    def __init__(self, async_engine: AsyncEngine, name: str, block_size: int, pool: PoolLink | None,
                 max_shadow_bytes: int, shadow_keep_s: float) -> None:
        self.engine = async_engine
        self.block_size = block_size
        self.pool = pool
        self.local = ColocatedWorker(async_engine, name)
        self.shadows = KVShadows(pool, block_size, max_shadow_bytes, shadow_keep_s) if pool is not None else None
        if self.shadows is not None:
            async_engine.after_step.append(self.shadows.after_step)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        if self.shadows is not None and req.output_token_ids and req.shadow_salt is not None:
            saved = await asyncio.to_thread(self.shadows.fetch, req)
            if saved is not None:
                async for event in self._resume(req, saved):
                    yield event
                return
        if self.pool is not None and not req.output_token_ids and req.num_prompt_tokens >= 2:
            hashes = prompt_block_hashes(req, self.block_size)
            reusable = hashes[: num_reusable_blocks(req.num_prompt_tokens, self.block_size)]
            await asyncio.to_thread(import_prefix, self.engine, self.pool, reusable, req.tenant)
        if self.shadows is not None:
            self.shadows.track(req.request_id, req)
        async for event in self.local.generate(req):
            yield event

    async def _resume(self, req: GenerationRequest, saved: Resume) -> AsyncIterator[TokenEvent]:
        """Runs a resumed request from its verified shadow blocks; only the tail is computed."""
        assert self.shadows is not None
        self.shadows.track(req.request_id, req, num_in_pool=saved.num_blocks, partial=saved.partial)
        apply_request_budget(self.engine, req)  # its own expert budget, if any (MoE models)
        outputs = self.engine.resume(req.request_id, list(req.prompt_token_ids), req.params, saved.kv,
                                     req.engine_options(), saved.num_tokens)
        try:
            async for out in outputs:
                yield TokenEvent.of(out, self.local.name)
        finally:
            await outputs.aclose()

    def shadow_stats(self) -> ShadowStats | None:
        return None if self.shadows is None else self.shadows.stats()

    @property
    def shadow_bytes(self) -> int:
        """Prefix-pool memory the KV shadows of the requests running here hold."""
        return 0 if self.shadows is None else self.shadows.stats().shadow_bytes
