"""The single-process inference engine: requests in, streamed token/text deltas out.

`add_request` validates (`RequestLimits`) and queues a request with its `RequestOptions`; `step`
runs one scheduler step (one forward over a continuous batch of prefill chunks and decodes),
samples, applies stop conditions and returns one `RequestOutput` per request that made progress;
`abort` drops a request and frees its blocks at once. The engine is not thread-safe: `AsyncEngine`
drives it from one thread.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.engine.block_hash import BlockHash
from actors.engine.config import EngineConfig, ModelConfig, parse_dtype
from actors.engine.errors import DuplicateRequestId, EmptyPrompt
from actors.engine.cuda_graphs import DecodeGraphs, graph_buckets
from actors.engine.device import resolve_device
from actors.engine.kv_cache_manager import KVCacheManager
from actors.engine.kv_exchange import KVExchange
from actors.engine.limits import RequestLimits
from actors.engine.memory import KVPlan, plan_kv_cache
from actors.engine.model import CausalLM
from actors.engine.model_runner import ModelRunner, SeqChunk
from actors.engine.offload import HostOffload
from actors.engine.options import RequestOptions
from actors.engine.output import EngineStats, OutputProcessor, RequestOutput, StepRecord
from actors.engine.request import Request, RequestStatus
from actors.engine.sampling import Sampler, SamplingParams, SamplingState
from actors.engine.scheduler import ScheduledBatch, Scheduler
from actors.engine.spec.decoder import SpecDecoder
from actors.engine.spec.proposers import DraftRow
from actors.engine.tokenizer import Tokenizer
from kernels import bound_onednn_caches

logger = logging.getLogger(__name__)
STEP_RECORDS_KEPT = 1024  # steps not taken by a reader (`take_step_records`) fall off the end


@dataclass(frozen=True)
class PreparedStep:
    batch: ScheduledBatch
    chunks: list[SeqChunk]
    due: list[Request]  # requests that sample a token from this step's logits
    started_s: float
    spec: list[DraftRow]  # rows that verify drafted tokens (their chunks carry the drafts)


class Engine(KVExchange):
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, cfg: EngineConfig | None = None,
                 draft_model: CausalLM | None = None) -> None:
        """`draft_model`: speculation's draft model (method "draft"); None loads `speculation.draft_model`."""
        cfg = cfg or EngineConfig()
        self.device = resolve_device(cfg.device)
        self.cfg = cfg.resolved(self.device)  # concrete device and dtype from here on
        bound_onednn_caches()  # before the first matmul of this process reads the capacities
        self.model_config: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        dtype = parse_dtype(self.cfg.dtype)
        self.max_model_len = min(self.cfg.max_model_len or model.cfg.max_position_embeddings,
                                 model.cfg.max_position_embeddings)
        model = model.to(device=self.device, dtype=dtype)
        if self.cfg.prepack_weights:
            model.pack_weights()  # after .to(), which would drop the packed copies (a no-op off CPU)
        self.kv_plan: KVPlan = plan_kv_cache(model, self.cfg, self.max_model_len)
        logger.info("%s", self.kv_plan.describe())
        num_blocks = self.num_blocks = self.kv_plan.num_blocks
        self.kv = KVCacheManager(num_blocks, self.cfg.block_size, self.cfg.enable_prefix_caching,
                                 self.cfg.tenant_kv_shares, self.cfg.kv_paging)
        self.limits = RequestLimits(model.cfg.vocab_size, self.max_model_len, num_blocks, self.cfg.block_size)
        offload = HostOffload.for_model(self.cfg.max_offload_bytes, model.cfg, self.cfg.block_size, dtype)
        self.scheduler = Scheduler(self.cfg, self.kv, offload)
        use_graphs = self.device.type == "cuda" and not self.cfg.enforce_eager and not model.cfg.is_moe
        self.runner = ModelRunner(model, num_blocks, self.cfg.block_size, self.cfg.kv_dtype, pad_block=use_graphs)
        if use_graphs:
            self.runner.graphs = DecodeGraphs(
                self.runner, graph_buckets(self.cfg.cuda_graph_batch_sizes, self.cfg.max_num_seqs), self.max_model_len)
        if self.cfg.speculation.method == "draft" and draft_model is None:
            from actors.engine.loader import load_model

            draft_model = load_model(self.cfg.speculation.draft_model, self.cfg)[0]
        self.spec = SpecDecoder(self.cfg.speculation, self.runner, self.kv, self.max_model_len, draft_model)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model.cfg.eos_token_ids)
        self.outputs = OutputProcessor(tokenizer)
        self.requests: dict[str, Request] = {}
        self._reserved: dict[str, Request] = {}  # KV arriving from another engine
        self._held: dict[str, Request] = {}  # finished, KV kept until release_kv
        self._executing: set[str] = set()  # requests of the step whose forward is running
        self._aborted: set[str] = set()  # aborts deferred to the end of that step
        self._rng = random.Random(self.cfg.seed)
        self._num_steps = 0
        self._last_step_s = 0.0
        self._num_forwarded_tokens = 0
        self._step_records: deque[StepRecord] = deque(maxlen=STEP_RECORDS_KEPT)
        # Called with each prepared step before its forward, on the engine thread (MoE routing
        # control fixes the step's table and lays out its budget rows: actors/engine/moe/control.py).
        self.step_hooks: list[Callable[[PreparedStep], None]] = []

    @classmethod
    def from_pretrained(cls, model: str | Path, cfg: EngineConfig | None = None) -> "Engine":
        """Builds an engine from a known model name (fetched into the cache if missing), a GGUF
        file or an HF folder, on the configured device."""
        from actors.engine.loader import load_model

        cfg = cfg or EngineConfig()
        cfg = cfg.resolved(resolve_device(cfg.device))
        return cls(*load_model(model, cfg), cfg)

    # ----------------------------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        options: RequestOptions | None = None,
    ) -> Request:
        """Validates and queues a request. `prompt` is text (tokenized with the model's tokenizer)
        or token ids. `options` (salt, resume point, KV hold, chunk cap, priority): see
        `RequestOptions`; None is a fresh interactive request."""
        options = options or RequestOptions()
        req = self._new_request(request_id, prompt, params, options)
        if options.arrival_time is not None:
            req.arrival_time = options.arrival_time
        req.hold_kv = options.holds_kv
        req.prefill_only = options.prefill_only
        req.max_chunk_tokens = options.max_chunk_tokens
        req.priority_rank = options.priority_rank
        self.requests[request_id] = req
        self.outputs.add(req)
        self.scheduler.add(req)
        return req

    def _new_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None, options: RequestOptions,
    ) -> Request:
        params = params or SamplingParams()
        if request_id in self.requests or request_id in self._reserved or request_id in self._held:
            raise DuplicateRequestId(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPrompt("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        output_token_ids = options.output_token_ids
        self.limits.check(token_ids + list(output_token_ids), params, len(output_token_ids))
        seed = options.seed
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling=SamplingState(params=params, seed=seed, prompt_token_ids=token_ids, output_token_ids=[]),
            block_size=self.cfg.block_size,
            extra_keys=options.extra_keys,
            num_shared_prefix_tokens=options.num_shared_prefix_tokens,
            tenant=options.tenant,
            speculation=options.speculation,
            tpot_target_s=options.tpot_target_s,
        )
        for t in output_token_ids:
            req.append_token(t)
        return req


    def abort(self, request_id: str) -> RequestOutput | None:
        """Drops a request wherever it is (queued, running, reserved, held) and frees its blocks."""
        if self.cancel_reservation(request_id) or self.release_kv(request_id):
            return None
        if request_id in self._executing:
            # Its blocks are being written by the forward pass in flight: freeing them now could
            # hand them to a reservation whose KV the forward would then overwrite.
            self._aborted.add(request_id)
            return None
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self.outputs.finish(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        prepared = self.prepare_step()
        if prepared is None:
            return []
        return self.finish_step(prepared, self.execute(prepared))

    def execute(self, prepared: PreparedStep) -> torch.Tensor:
        """The step's forward (and its drafting passes, when rows speculate): its logits. Runs
        outside the engine's bookkeeping (see `prepare_step`)."""
        self.spec.draft(prepared.spec, prepared.chunks)
        return self.runner.execute(prepared.chunks)

    def prepare_step(self) -> PreparedStep | None:
        """Schedules one step. Between this and `finish_step` the forward runs, and other engine calls
        (add, abort, reserve, write KV into reserved blocks) may interleave: the step's blocks stay
        referenced until `finish_step`, and an abort of one of its requests is deferred to it."""
        batch = self.scheduler.schedule()
        self.scheduler.offload.apply(self.runner)  # before anything writes the blocks it took
        if not batch.requests:
            return None
        chunks = []
        due: list[Request] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            needs_logits = start + n == req.num_tokens and not req.prefill_only
            chunks.append(SeqChunk(req.token_ids[start : start + n], start, self.kv.block_ids(req.request_id), needs_logits))
            if needs_logits:
                due.append(req)
        spec = self.spec.plan(batch, chunks, self.cfg.max_num_batched_tokens)
        self._executing = {r.request_id for r in batch.requests}
        prepared = PreparedStep(batch, chunks, due, time.perf_counter(), spec)
        for hook in self.step_hooks:
            hook(prepared)
        return prepared

    def finish_step(self, prepared: PreparedStep, logits: torch.Tensor) -> list[RequestOutput]:
        batch, due = prepared.batch, prepared.due
        self._executing = set()
        outputs = []
        prefill_tokens, prefill_pairs, decode_rows, decode_context = 0, 0.0, 0, 0
        for req, n, chunk in zip(batch.requests, batch.num_new_tokens, prepared.chunks):
            start, forwarded = req.num_computed_tokens, len(chunk.token_ids)  # a verify: 1 + drafts
            if forwarded == 1 and start > 0:
                decode_rows += 1
                decode_context += start + 1
            else:
                prefill_tokens += forwarded
                prefill_pairs += forwarded * (start + forwarded / 2.0)
            req.num_computed_tokens += n
            req.num_forwarded_tokens += forwarded
            self.kv.cache_computed_blocks(req)
            if req.prefill_only and req.num_computed_tokens == req.num_tokens and req.request_id not in self._aborted:
                outputs.append(self._finish(req, RequestStatus.FINISHED_PREFILLED, self.outputs.finish))
        num_forwarded = sum(len(c.token_ids) for c in prepared.chunks)
        self._num_forwarded_tokens += num_forwarded
        emitted = []
        if due:
            speculating = {r.req.request_id for r in prepared.spec}
            for req, (tokens, lps) in zip(due, self.spec.sample(self.sampler, logits, due, prepared.spec,
                                                                self.eos_token_ids)):
                emitted.append(len(tokens))
                if req.request_id in self._aborted:
                    continue
                status = None
                for token_id, lp in zip(tokens, lps):  # 1 + accepted drafts, up to a stop
                    req.append_token(token_id)
                    out, status = self.outputs.on_token(req, token_id, lp, self._check_stop(req, token_id))
                    outputs.append(out)
                    if status is not None:
                        break
                if req.request_id in speculating:
                    self.spec.settle(req)
                if status is not None:
                    self._finish(req, status)
        for request_id in self._aborted:
            out = self.abort(request_id)
            if out is not None:
                outputs.append(out)
        self._aborted = set()
        self._num_steps += 1
        self._last_step_s = time.perf_counter() - prepared.started_s
        self.spec.observe(due, emitted, num_forwarded, self._last_step_s, self.requests.keys())
        self._step_records.append(
            StepRecord(prefill_tokens, prefill_pairs, decode_rows, decode_context, self._last_step_s))
        return outputs

    def take_step_records(self) -> list[StepRecord]:
        """The steps since the last call (the newest `STEP_RECORDS_KEPT` at most), oldest first."""
        return [self._step_records.popleft() for _ in range(len(self._step_records))]

    def cached_block_hashes(self) -> list[BlockHash]:
        """Hashes of the prefix blocks held (in use or evictable); call between steps (`AsyncEngine.locked`)."""
        return self.kv.pool.cached_hashes()

    def _finish(self, req: Request, status: RequestStatus, make_output=None):  # type: ignore[no-untyped-def]
        self.scheduler.finish(req, status, free_kv=not req.hold_kv)
        if req.hold_kv:
            self._held[req.request_id] = req
        del self.requests[req.request_id]
        return make_output(req) if make_output else None

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if token_id in p.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ------------------------------------------------------------------------------------ helpers
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Runs prompts to completion; one final output each."""
        ids = [f"gen-{self._rng.getrandbits(48):012x}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, params)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)

    def stats(self) -> EngineStats:
        pool = self.kv.pool.stats()
        prefix = self.kv.prefix_stats()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks_total=pool.num_blocks,
            num_blocks_free=pool.num_free_blocks,
            num_blocks_cached=pool.num_cached_blocks,
            num_prefix_queried_tokens=prefix.num_queried_tokens,
            num_prefix_hit_tokens=prefix.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_evictions=pool.num_evictions,
            num_offloads=self.scheduler.offload.num_offloads,
            offloaded_bytes=self.scheduler.offload.used_bytes,
            kv_blocks_by_tenant=tuple(sorted(self.kv.pool.usage().items())),
            spec_method=self.cfg.speculation.method,
            num_spec_steps=self.spec.num_spec_steps,
            num_spec_rounds=self.spec.num_spec_rounds,
            num_decode_rows=self.spec.num_decode_rows,
            num_draft_tokens=self.spec.num_draft_tokens,
            num_accepted_tokens=self.spec.num_accepted_tokens,
            num_steps=self._num_steps,
            num_forwarded_tokens=self._num_forwarded_tokens,
            last_step_s=self._last_step_s,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        live = {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}
        assert live == set(self.requests), (live, set(self.requests))
