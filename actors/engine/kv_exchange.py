"""The engine's KV exchange with other engines: KV computed elsewhere comes in (the decode side of
disaggregation: `reserve` then `commit`; a resume from saved KV; prefix-pool blocks), and a finished
request's KV stays held for whoever ships it out (`held_kv`, `release_kv`).

`KVExchange` is a part of `Engine` (engine.py), kept apart as its own noun; it uses the engine's
KV manager, scheduler, runner and request tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.engine.block_hash import BlockHash
from actors.engine.options import RequestOptions
from actors.engine.request import Request
from actors.engine.sampling import SamplingParams


class KVExchange:
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, options: RequestOptions,
                *, num_kv_tokens: int) -> list[int] | None:
        """Decode side of disaggregation, step 1: validates the request (prompt + `options`' output
        tokens) and allocates blocks for the `num_kv_tokens` tokens whose KV another engine computed
        (offloading batch KV for an interactive request: `Scheduler.make_room`). Returns the block
        ids to write (`runner.write_blocks`), or None when the pool or the batch has no room now."""
        req = self._new_request(request_id, prompt_token_ids, params, options)
        assert 0 < num_kv_tokens < req.num_tokens, "the last token's KV is computed here, by the first decode"
        req.priority_rank = options.priority_rank
        if self.scheduler.make_room(req, num_kv_tokens, need_row=self._rows_taken(), busy=self._executing):
            self.scheduler.offload.apply(self.runner)  # read out before this KV lands in those blocks
        if self._rows_taken(promised=self.scheduler.num_resumes_waiting(req.priority_rank)):
            return None  # no row, or the rows that are free go to waiting resumes first
        if not self.kv.allocate_slots(req, num_kv_tokens):
            return None
        req.num_computed_tokens = num_kv_tokens
        self._reserved[request_id] = req
        return self.kv.block_ids(request_id)

    def commit(self, request_id: str) -> Request:
        """Step 2, once every shard is written: the request joins the running batch."""
        req = self._reserved.pop(request_id)
        self.kv.cache_computed_blocks(req)
        self.requests[request_id] = req
        self.outputs.add(req)
        self.scheduler.add_running(req)
        return req

    def resume_from_kv(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       kv: torch.Tensor, options: RequestOptions, num_kv_tokens: int | None = None) -> bool:
        """Resumes a request (prompt + `options.output_token_ids`) from the KV its last engine saved
        of its first `num_kv_tokens` tokens (default: all of `kv` [L, 2, n, block_size, Hkv, D]). The
        tail is computed here, its output positions one token a step as the interrupted decode
        steps did, so the continuation has the same bits. False (nothing changed): no room now."""
        bs = self.cfg.block_size
        num_tokens = len(prompt_token_ids) + len(options.output_token_ids)
        n = min(kv.shape[2] * bs if num_kv_tokens is None else num_kv_tokens, num_tokens - 1)
        if n < 1 or n > kv.shape[2] * bs:
            raise ValueError(f"{request_id}: {n} tokens of saved KV do not fit {kv.shape[2]} blocks, or none to resume")
        block_ids = self.reserve(request_id, prompt_token_ids, params, options, num_kv_tokens=n)
        if block_ids is None:
            return False
        self.runner.write_blocks(block_ids, kv[:, :, : len(block_ids)])
        self.commit(request_id).stepwise_from = len(prompt_token_ids) - 1
        return True

    def _rows_taken(self, promised: int = 0) -> bool:
        return len(self.scheduler.running) + len(self._reserved) + promised >= self.cfg.max_num_seqs

    def is_reserved(self, request_id: str) -> bool:
        return request_id in self._reserved  # blocks wait for the request's KV, not yet committed

    def cancel_reservation(self, request_id: str) -> bool:
        """KV that never arrived: frees the reserved blocks."""
        req = self._reserved.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True

    def import_cached_blocks(self, block_hashes: Sequence[BlockHash], kv: torch.Tensor, tenant: str = "") -> int:
        """Writes blocks fetched from the prefix-cache pool (`kv`: [L, 2, n, block_size, Hkv, D]) into this
        engine's prefix cache, free-but-cached under their hashes, charged to `tenant`; how many (0: no room)."""
        n = len(block_hashes)
        assert kv.shape[2] == n
        if not self.cfg.enable_prefix_caching or n == 0 or not self.kv.pool.can_allocate(n):
            return 0
        blocks = self.kv.pool.allocate(n, tenant)
        self.runner.write_blocks([b.block_id for b in blocks], kv)
        for block, block_hash in zip(blocks, block_hashes):
            self.kv.pool.cache_block(block, block_hash)
        self.kv.pool.free(reversed(blocks))
        return n

    def cached_prefix_len(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a hash chain this engine holds in its prefix cache."""
        return self.kv.cached_prefix_len(block_hashes)

    def held_kv(self, request_id: str) -> tuple[list[int], int]:
        """(block ids, number of tokens with KV) of a finished `hold_kv` request."""
        req = self._held[request_id]
        return self.kv.block_ids(request_id), req.num_computed_tokens

    def release_kv(self, request_id: str) -> bool:
        req = self._held.pop(request_id, None)
        if req is None:
            return False
        self.kv.free(req)
        return True
