"""The decode half of a simulated engine, shared by decode-only and colocated instances.

Mental model: decode is simulated without touching every row every step. A request joining at
step s with context c0 has context c0 + (j - 1 - s) in step j, so the batch's total context in
step j is sum(c0 - s - 1) + B * j, kept as one running sum `S`; each request's finishing step is
known when it joins (`join + tokens left`) and sits in a heap. A step costs O(log n) for the rows
that finish, not O(batch).
KV blocks are reserved for prompt + the full output at admission (an oracle for memory, the same
for every policy, so no policy loses time to preemption on out-of-memory).
"""

from __future__ import annotations

import heapq
import itertools

from bench.sim.request import DECODING, SimRequest

_seq = itertools.count()


class DecodeRows:
    """A continuous decode batch and the KV blocks it holds."""

    def __init__(self, block_tokens: int, kv_blocks: int) -> None:
        self.block_tokens = block_tokens
        self.kv_blocks = kv_blocks
        self.used_blocks = 0
        self.steps_done = 0
        self.rows: dict[str, SimRequest] = {}
        self._finish: list[tuple[int, int, SimRequest]] = []
        self._s = 0  # sum over rows of (c0 - join - 1)
        self.just_joined: list[SimRequest] = []

    def blocks_for(self, req: SimRequest) -> int:
        return -(-(req.prompt_len + req.out_len) // self.block_tokens)

    def join(self, req: SimRequest, blocks: int) -> None:
        req.join_step, req.gen_at_join, req.blocks = self.steps_done, req.generated, blocks
        req.s_term = req.prompt_len + req.generated - self.steps_done - 1
        self._s += req.s_term
        self.used_blocks += blocks
        self.rows[req.rid] = req
        req.state = DECODING
        heapq.heappush(self._finish, (self.steps_done + req.out_len - req.generated, next(_seq), req))
        self.just_joined.append(req)

    def context_next_step(self) -> int:
        return self._s + len(self.rows) * (self.steps_done + 1)

    def generated_now(self, req: SimRequest) -> int:
        return req.gen_at_join + (self.steps_done - req.join_step)

    def leave(self, req: SimRequest) -> None:
        del self.rows[req.rid]
        self._s -= req.s_term
        self.used_blocks -= req.blocks

    def finished_rows(self) -> list[SimRequest]:
        """Advance one step; rows whose last token came out in it (their count is final)."""
        self.steps_done += 1
        out = []
        heap = self._finish
        while heap and heap[0][0] <= self.steps_done:
            _, _, req = heapq.heappop(heap)
            if self.rows.get(req.rid) is req:
                self.leave(req)
                req.generated = req.out_len
                out.append(req)
        return out
