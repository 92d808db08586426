"""Who drafts the tokens a speculating row verifies.

- `NgramProposer` (prompt lookup): the last n tokens (n from `ngram_max` down to `ngram_min`) are
  searched for in the request's earlier tokens, prompt and output; the tokens that followed their
  latest earlier occurrence are the drafts. Free to compute, and right where the output copies its
  input (code editing, quoting, summaries that reuse phrases).
- `ModelDrafter`: a causal LM drafts greedily (or by sampling, for rejection-sampled verification),
  one token per pass for every drafting row together. Two kinds:
  * early exit (self-speculation): the target model's own first `exit_layer` layers, its final norm
    and head. It shares the target's KV cache: the layers it runs are the target's, their KV for
    accepted tokens is what the verify forward writes anyway, and what a draft pass writes at a
    position is rewritten by the verify forward of that position. Nothing to catch up.
  * a separate draft model with its own paged cache laid out on the target's block ids (so it
    needs no allocator of its own). Each row's draft KV is caught up from the last position it
    holds (the whole prompt, the first time) in the row's first pass.
Drafts only change how fast tokens come, never which: verification (verify.py) decides every token.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch

from actors.engine.model import CausalLM
from actors.engine.model_runner import ModelRunner, SeqChunk
from actors.engine.request import Request
from actors.engine.sampling import draw, filter_probs, uniform_for
from actors.engine.spec.verify import DRAFT_STREAM

NGRAM_WINDOW = 8192  # tokens searched back from the end (code files, documents: the prompt fits)


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._arrays: dict[str, np.ndarray] = {}  # request -> its tokens, grown as they come (no list copy a step)

    def propose(self, token_ids: list[int], k: int, request_id: str | None = None) -> list[int]:
        """Up to `k` drafts continuing `token_ids`, or none when no n-gram of the tail recurs: the
        tokens after the latest earlier occurrence of the longest recurring tail (n-gram_max down
        to ngram_min tokens). One vectorised compare finds where the last token recurs; only those
        places are extended backwards."""
        tokens = self._tokens(token_ids, request_id)[-NGRAM_WINDOW:]
        size = len(tokens)
        ends = np.flatnonzero(tokens[: size - 1] == tokens[-1])  # earlier places of the last token
        if ends.size == 0 or size <= self.ngram_min:
            return []
        matched = np.ones(ends.size, dtype=np.int64)  # how many tail tokens agree, backwards from each
        alive = np.ones(ends.size, dtype=bool)
        for d in range(1, min(self.ngram_max, size - 1)):
            before = ends - d
            ok = alive & (before >= 0)
            ok[ok] = tokens[before[ok]] == tokens[size - 1 - d]
            matched += ok
            alive = ok
            if not alive.any():
                break
        longest = int(matched.max())
        if longest < self.ngram_min:
            return []
        start = int(ends[np.flatnonzero(matched == longest)[-1]]) + 1
        return tokens[start : start + k].tolist()

    def _tokens(self, token_ids: list[int], request_id: str | None) -> np.ndarray:
        if request_id is None:
            return np.asarray(token_ids, dtype=np.int64)
        arr = self._arrays.get(request_id)
        if arr is None or len(arr) > len(token_ids):
            arr = np.asarray(token_ids, dtype=np.int64)
        elif len(arr) < len(token_ids):
            arr = np.concatenate([arr, np.asarray(token_ids[len(arr):], dtype=np.int64)])
        self._arrays[request_id] = arr
        return arr

    def forget(self, live: Collection[str]) -> None:
        for rid in [rid for rid in self._arrays if rid not in live]:
            del self._arrays[rid]


@dataclass
class DraftRow:
    """One row's drafting this step: its request, its k, and the drafts (and their probs) made."""

    req: Request
    k: int
    block_ids: list[int]
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # q rows [V], sampled drafts only
    sampled: bool = False
    index: int = -1  # the row's chunk in the step

    def __post_init__(self) -> None:
        self.last = self.req.num_tokens - 1  # the position of the row's last token, the first one it feeds


class ModelDrafter:
    def __init__(self, runner: ModelRunner, num_layers: int | None, shares_cache: bool) -> None:
        """`runner` runs the drafting model (the target's own, with `num_layers`, for early exit);
        `shares_cache`: its cache is the target's (nothing to catch up)."""
        self.runner = runner
        self.num_layers = num_layers
        self.shares_cache = shares_cache
        self._done: dict[str, tuple[int, list[int]]] = {}  # separate draft: (positions held, their blocks)

    @classmethod
    def early_exit(cls, runner: ModelRunner, exit_layer: int) -> "ModelDrafter":
        return cls(runner, exit_layer, shares_cache=True)

    @classmethod
    def separate(cls, draft: CausalLM, target_runner: ModelRunner, num_blocks: int) -> "ModelDrafter":
        tcfg, dcfg = target_runner.model.cfg, draft.cfg
        if dcfg.vocab_size != tcfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({dcfg.vocab_size}) is not the target's ({tcfg.vocab_size})")
        draft = draft.to(device=target_runner.device, dtype=target_runner.model_dtype)
        runner = ModelRunner(draft, num_blocks, target_runner.block_size, target_runner.model_dtype)
        return cls(runner, None, shares_cache=False)

    def draft(self, rows: list[DraftRow]) -> None:
        """Fills each row's `drafts` (k of them), one batched pass per draft position."""
        for j in range(max((r.k for r in rows), default=0)):
            active = [r for r in rows if r.k > j]
            chunks = [self._chunk(r, j) for r in active]
            logits = self.runner.execute(chunks, self.num_layers)
            for r, row in zip(active, logits):
                if r.sampled:
                    q = filter_probs(row, r.req.params).double()
                    q = q / q.sum()
                    pos = r.req.num_output_tokens + j
                    r.drafts.append(draw(q, uniform_for(r.req.sampling.seed ^ DRAFT_STREAM, pos)))
                    r.probs.append(q)
                else:
                    r.drafts.append(int(row.argmax()))

    def _chunk(self, r: DraftRow, j: int) -> SeqChunk:
        req, last = r.req, r.last
        if j > 0:
            return SeqChunk([r.drafts[j - 1]], last + j, r.block_ids, True)
        start = last if self.shares_cache else self._start(req, r.block_ids)
        return SeqChunk(req.token_ids[start:], start, r.block_ids, True)

    def _start(self, req: Request, block_ids: list[int]) -> int:
        """First position whose draft KV a separate draft model must compute for this request."""
        done, blocks = self._done.get(req.request_id, (0, []))
        if block_ids[: len(blocks)] != blocks or done >= req.num_tokens:
            return 0  # its blocks changed (preempted, recomputed): start over
        return done

    def verified(self, r: DraftRow, num_accepted: int) -> None:
        """After verification: the draft KV positions that hold accepted tokens stay valid."""
        if self.shares_cache:
            return
        done = r.last + 1 + min(num_accepted, r.k - 1)
        bs = self.runner.block_size
        self._done[r.req.request_id] = (done, r.block_ids[: -(-done // bs)])

    def forget(self, live: Collection[str]) -> None:
        for rid in [rid for rid in self._done if rid not in live]:
            del self._done[rid]
