"""The prefill worker: computes a prompt's KV, reusing every cached block it can, and ships it to decode.

Mental model, one `prefill(req, decode_peer)`:
  1. lookup: the prompt's chained block hashes (salted per tenant) -> how many leading blocks this
     engine's own prefix cache holds -> the next blocks of the chain from the prefix-cache pool,
     decoded and imported into the engine's prefix cache, so step 2 reuses them like local ones;
  2. compute: a prefill-only engine run (chunked, batched with other prefills): only the tokens
     after the reused prefix go through the model; the KV stays held, nothing is sampled;
  3. transfer: the blocks of the first `len(prompt) - 1` tokens are read, encoded (with the codec
     the tenant's policy allows and `self.codecs` predicts fastest to that peer:
     transfer/codec_choice.py; in layer-group shards) and sent to the decode worker's endpoint;
     the held blocks are released once the receiver holds every shard, or on any failure;
  4. in the background, the prompt's full blocks the pool lacks are offered to it.
The answer is a `PrefillResult` with the counts and the time of each stage. Every blocking call
(engine lock, pool, transport) runs on this worker's threads, never on the event loop.

While a dead lone decode worker's replacement starts, the router may lend this worker its streams:
`generate` then runs one whole here, resumed from its KV shadows (`whole_runs.py`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from actors.colocated import read_load
from actors.engine.async_engine import AsyncEngine
from actors.engine.block_hash import BlockHash
from actors.engine.engine import Engine
from actors.handoff import (
    num_handoff_blocks, num_handoff_shards, num_reusable_blocks, prompt_block_hashes, transfer_tag,
    zero_stale_tail,
)
from actors.kv_shadow import ShadowStats
from actors.messages import GenerationRequest, PrefillResult, TokenEvent, WorkerLoad
from actors.moe_handoff import (
    apply_request_budget, choice_tag, encode_choice, forget_request, take_expert_choice,
)
from actors.pool_link import PoolLink, PoolLinkStats, import_prefix
from actors.prefix_cache.pool import PrefixCachePool
from actors.telemetry import ReportsTelemetry
from actors.whole_runs import WholeRuns
from actors.worker_config import WorkerConfig
from transfer.codec import KVLayout, encode
from transfer.codec_choice import CodecChoice, CodecChooser, link_class
from transfer.cuda_ipc import this_node
from transfer.transport import KVTransport, SendStats, takes_device_shards

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Shipped:
    """One handoff's send, its codec choice, and its measured encode and encode + send + decode seconds."""

    sent: SendStats
    choice: CodecChoice
    encode_s: float
    actual_s: float  # the decode term is the chooser's prediction: the receiver decodes after the send
    experts: list[list[int]] | None = None  # the expert choice sent ahead of the KV (MoE, budgeted)


class PrefillWorker(ReportsTelemetry):
    def __init__(self, cfg: WorkerConfig, async_engine: AsyncEngine, transport: KVTransport, layout: KVLayout,
                 prefix_pool: PrefixCachePool | None = None, name: str | None = None) -> None:
        self.cfg = cfg
        self.engine = async_engine
        self.transport = transport
        self.layout = layout
        self.name = name or transport.name
        # A shard must fit both our send staging and the receiver's (same config on both ends).
        self._staging_bytes = min(cfg.transfer.send_staging_bytes, cfg.transfer.recv_staging_bytes)
        self.pool = PoolLink(prefix_pool, layout, cfg.pool_codec_for, cfg.max_pending_offers, exact_for=cfg.exact_kv) if prefix_pool else None
        # Whole requests: only when the router lends this worker to a dead decode worker's streams
        # until its replacement is up (they resume from their KV shadows, and keep shadowing).
        self.runs = WholeRuns(async_engine, self.name, layout.block_size, self.pool, cfg.max_shadow_bytes, cfg.shadow_keep_s)
        # Which codec each transfer uses (the policy's, or the one predicted fastest to each peer),
        # from codec costs measured here once and then on every transfer.
        runner = self._engine.runner
        device_shards = runner.device.type == "cuda" and takes_device_shards(transport)
        self.codecs = CodecChooser.calibrated(layout, runner.model_dtype, runner.device, device_shards=device_shards,
                                              num_shards=cfg.num_shards,
                                              default_link=link_class(getattr(transport, "kind", ""), "", None))
        # Enough threads that a slow send or pool fetch does not hold up other requests' lookups.
        self._threads = ThreadPoolExecutor(max_workers=8, thread_name_prefix=f"prefill-{self.name}")

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._threads, functools.partial(fn, *args))

    @property
    def _engine(self) -> Engine:
        return self.engine.engine

    async def prefill(self, req: GenerationRequest, decode_peer: str) -> PrefillResult:
        """Computes the prompt's KV and sends it to `decode_peer` (a name `add_peer` returned).
        Raises the engine's `InvalidRequest` for bad input and `TransferError`s of the send."""
        started = time.time()
        if not req.needs_handoff:
            raise ValueError(f"{req.request_id}: nothing to hand over; the decode worker runs it alone")
        num_prompt = req.num_prompt_tokens
        hashes = prompt_block_hashes(req, self.layout.block_size)
        reusable = hashes[: num_reusable_blocks(num_prompt, self.layout.block_size)]
        num_local, num_pool = await self._call(import_prefix, self.engine, self.pool, reusable, req.tenant)
        looked_up = time.time()

        apply_request_budget(self.engine, req)  # its own expert budget, if any (MoE models)
        final = None
        try:
            async for out in self.engine.generate(req.request_id, list(req.prompt_token_ids), req.params,
                                                  req.engine_options(prefill_only=True)):
                final = out
        except BaseException:
            if req.expert_budget is not None:  # refused before any step: no step would ever drop it
                await self._call(self.engine.locked, forget_request, self._engine, req.request_id)
            raise
        assert final is not None and final.finish_reason == "prefilled", final
        computed = time.time()
        try:
            kv, shipped_kv = await self._call(self._ship, req, hashes, decode_peer)
        finally:
            await self._call(self.engine.locked, self._engine.release_kv, req.request_id)
        shipped = time.time()
        if self.pool is not None:
            self.pool.offer(hashes, kv[:, :, : len(hashes)], req.tenant)  # full blocks only: a partial one has no hash
        sent, choice = shipped_kv.sent, shipped_kv.choice
        return PrefillResult(
            request_id=req.request_id, worker=self.name, num_prompt_tokens=num_prompt,
            num_computed_tokens=num_prompt - final.num_cached_tokens, num_local_hit_blocks=num_local,
            num_pool_hit_blocks=num_pool, num_kv_blocks=kv.shape[2], kv_raw_bytes=sent.raw_bytes,
            kv_wire_bytes=sent.wire_bytes, num_shards=sent.num_shards, queued_s=max(0.0, started - req.arrival_time),
            lookup_s=looked_up - started, compute_s=computed - looked_up, transfer_s=shipped - computed,
            finished_at=shipped, kv_codec=choice.name, kv_codec_reason=choice.reason,
            kv_codec_predicted_s=choice.chosen_predicted_s, kv_codec_actual_s=shipped_kv.actual_s,
            kv_encode_s=shipped_kv.encode_s, kv_send_s=sent.latency_s,
            kv_codec_predictions=tuple(choice.predicted_s.items()),
            kv_fidelity=self.cfg.kv_policy(req.tenant).fidelity,
            expert_choice=None if shipped_kv.experts is None else tuple(map(tuple, shipped_kv.experts)),
        )

    async def prefetch(self, req: GenerationRequest) -> None:
        """While `req` waits to be prefilled here: asks the pool to bring the part of its prefix
        this engine lacks up from disk, so the lookup in `prefill` finds it in DRAM."""
        if self.pool is None or not req.needs_handoff:
            return
        reusable = prompt_block_hashes(req, self.layout.block_size)[: num_reusable_blocks(req.num_prompt_tokens,
                                                                                          self.layout.block_size)]
        num_local = await self._call(self.engine.locked, self._engine.cached_prefix_len, reusable)
        await self._call(self.pool.prefetch, reusable[num_local:])

    def _ship(self, req: GenerationRequest, hashes: list[BlockHash], decode_peer: str) -> tuple[torch.Tensor, Shipped]:
        n = num_handoff_blocks(req.num_prompt_tokens, self.layout.block_size)
        kv, experts = self.engine.locked(self._read_held, req, n)  # [L, 2, n, bs, Hkv, D], a copy
        if experts is not None:  # an MoE request with an expert budget: its choice lands before its KV
            self.transport.send(decode_peer, [encode_choice(experts)], tag=choice_tag(req.request_id),
                                timeout_s=self.cfg.transfer_timeout_s)
        zero_stale_tail(kv, req.num_prompt_tokens, self.layout.block_size)
        tag, raw_bytes = transfer_tag(req.request_id), kv.numel() * kv.element_size()
        choice = self.codecs.choose(decode_peer, raw_bytes, self.cfg.codecs_for(req.tenant))
        started = time.perf_counter()
        shards = encode(kv, self.layout, compression=choice.codec,
                        num_shards=num_handoff_shards(raw_bytes, self.layout.num_layers, self.cfg.num_shards,
                                                      self._staging_bytes),
                        block_hashes=[*hashes[:n], *[0] * (n - len(hashes[:n]))], transfer_id=tag,
                        device=kv.device if kv.is_cuda and takes_device_shards(self.transport) else None)
        encode_s = time.perf_counter() - started
        sent = self.transport.send(decode_peer, shards, tag=tag, timeout_s=self.cfg.transfer_timeout_s)
        self.codecs.record(decode_peer, choice.codec, raw_bytes, sent.wire_bytes, encode_s, sent.latency_s)
        actual_s = encode_s + sent.latency_s + self.codecs.decode_s(choice.codec, raw_bytes)
        return kv, Shipped(sent, choice, encode_s, actual_s, experts)

    def _read_held(self, req: GenerationRequest, num_blocks: int) -> tuple[torch.Tensor, list[list[int]] | None]:
        # Under the engine lock: one wait for the blocks and the expert choice (`moe_handoff.py`).
        block_ids, _ = self._engine.held_kv(req.request_id)
        return self._engine.runner.read_blocks(block_ids[:num_blocks]), take_expert_choice(self._engine, req)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Runs a request whole here, decode included (a dead decode worker's stream, lent)."""
        async for event in self.runs.generate(req):
            yield event

    async def abort(self, request_id: str) -> bool:
        return await self.runs.local.abort(request_id)

    def shadow_stats(self) -> ShadowStats | None:
        return self.runs.shadow_stats()

    # ------------------------------------------------------------------------ wiring, stats
    async def add_peer(self, metadata: bytes, node: str | None = None) -> str:
        """Learns a decode worker's endpoint; returns the name to pass to `prefill`. `node` (the
        peer's `this_node()`, when the caller knows it) picks the link prior its codec choice
        starts from."""
        peer = await self._call(self.transport.add_peer, metadata)
        self.codecs.set_link(peer, link_class(getattr(self.transport, "kind", ""), this_node(), node))
        return peer

    async def flush_offers(self, timeout_s: float = 10.0) -> bool:
        """Waits until background pool offers are done (tests, orderly shutdown)."""
        return True if self.pool is None else await self._call(self.pool.flush, timeout_s)

    def pool_stats(self) -> PoolLinkStats | None:
        return None if self.pool is None else self.pool.stats()

    async def load(self) -> WorkerLoad:
        load = read_load(self.engine, self.name, "prefill", shadow_bytes=self.runs.shadow_bytes)
        return load if self.pool is None else replace(load, pool_fetch_s_per_block=self.pool.fetch_s_per_block)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
        self.engine.shutdown()
