"""The single-process inference engine: requests in, streamed token/text deltas out.

`add_request` validates and queues; `step` runs one scheduler step (one forward over a continuous
batch of prefill chunks and decodes), samples, applies stop conditions and returns one
`RequestOutput` per request that made progress; `abort` drops a request and frees its blocks at
once. The engine is not thread-safe: `AsyncEngine` drives it from one thread.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from actors.engine.config import EngineConfig, ModelConfig, parse_dtype
from actors.engine.errors import (
    ContextLengthExceeded,
    DuplicateRequestId,
    EmptyPrompt,
    InvalidSamplingParams,
    TokenOutOfVocab,
)
from actors.engine.kv_cache_manager import KVCacheManager
from actors.engine.model import CausalLM
from actors.engine.model_runner import ModelRunner, SeqChunk, kv_bytes_per_block
from actors.engine.output import EngineStats, OutputProcessor, RequestOutput
from actors.engine.request import Request, RequestStatus
from actors.engine.sampling import Sampler, SamplingParams, SamplingState
from actors.engine.scheduler import Scheduler
from actors.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: CausalLM, tokenizer: Tokenizer, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg or EngineConfig()
        self.model_config: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        dtype = parse_dtype(self.cfg.dtype)
        self.max_model_len = min(self.cfg.max_model_len or model.cfg.max_position_embeddings,
                                 model.cfg.max_position_embeddings)
        num_blocks = self.cfg.num_blocks or max(
            1, self.cfg.kv_cache_bytes // kv_bytes_per_block(model.cfg, self.cfg.block_size, dtype)
        )
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(num_blocks, self.cfg.block_size, self.cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.cfg, self.kv)
        self.runner = ModelRunner(model.to(dtype), num_blocks, self.cfg.block_size, dtype)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model.cfg.eos_token_ids)
        self.outputs = OutputProcessor(tokenizer)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(self.cfg.seed)
        self._num_steps = 0
        self._last_step_s = 0.0
        self._num_forwarded_tokens = 0

    @classmethod
    def from_pretrained(cls, model: str | Path, cfg: EngineConfig | None = None) -> "Engine":
        """Builds an engine from a known model name (fetched into the cache if missing), a GGUF
        file or an HF folder."""
        from actors.engine.fetch import resolve_model
        from actors.engine.weights import load_weights

        path = resolve_model(str(model))
        t0 = time.perf_counter()
        loaded = load_weights(path)
        tokenizer = Tokenizer.load(path)
        with torch.device("meta"):
            net = CausalLM(loaded.config)
        net = net.to_empty(device="cpu")
        net.rope.__init__(loaded.config)  # buffers are not weights: rebuild them off the meta device
        net.load_weights(loaded.tensors)
        net.eval()
        logger.info("loaded %s in %.1fs", path, time.perf_counter() - t0)
        return cls(net, tokenizer, cfg)

    # ----------------------------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        extra_keys: tuple[object, ...] = (),
        arrival_time: float | None = None,
    ) -> Request:
        """Validates and queues a request. `prompt` is text (tokenized with the model's tokenizer)
        or token ids. `extra_keys` go into every block hash (e.g. a tenant's cache salt)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise DuplicateRequestId(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if not prompt:
                raise EmptyPrompt("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        self._validate(token_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling=SamplingState(params=params, seed=seed, prompt_token_ids=token_ids, output_token_ids=[]),
            block_size=self.cfg.block_size,
            extra_keys=extra_keys,
        )
        if arrival_time is not None:
            req.arrival_time = arrival_time
        self.requests[request_id] = req
        self.outputs.add(req)
        self.scheduler.add(req)
        return req

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise EmptyPrompt("prompt has no tokens")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise TokenOutOfVocab(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise InvalidSamplingParams(f"stop_token_ids {bad_stop[:5]} are outside the vocabulary [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthExceeded(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model's context of {self.max_model_len} tokens"
            )
        if self.kv.num_blocks_needed(total) > self.num_blocks:
            raise ContextLengthExceeded(
                f"prompt + max_tokens = {total} tokens needs more KV blocks than this engine holds "
                f"({self.num_blocks} blocks of {self.cfg.block_size})"
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self.outputs.finish(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        t0 = time.perf_counter()
        chunks = []
        due: list[Request] = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start = req.num_computed_tokens
            needs_logits = start + n == req.num_tokens
            chunks.append(SeqChunk(req.token_ids[start : start + n], start, self.kv.block_ids(req.request_id), needs_logits))
            if needs_logits:
                due.append(req)
        logits = self.runner.execute(chunks)
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            req.num_forwarded_tokens += n
            self.kv.cache_computed_blocks(req)
        self._num_forwarded_tokens += batch.num_tokens
        outputs = []
        if due:
            result = self.sampler.sample(logits, [r.sampling for r in due], self.eos_token_ids)
            for req, token_id, lp in zip(due, result.token_ids, result.logprobs):
                req.append_token(token_id)
                out, status = self.outputs.on_token(req, token_id, lp, self._check_stop(req, token_id))
                if status is not None:
                    self.scheduler.finish(req, status)
                    del self.requests[req.request_id]
                outputs.append(out)
        self._num_steps += 1
        self._last_step_s = time.perf_counter() - t0
        return outputs

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
        """Runs prompts to completion; returns one final output each with all tokens and text."""
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
            num_steps=self._num_steps,
            num_forwarded_tokens=self._num_forwarded_tokens,
            last_step_s=self._last_step_s,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        live = {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}
        assert live == set(self.requests), (live, set(self.requests))
