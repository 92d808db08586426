"""What an engine can take: the checks a request passes before it touches any engine state.

Mental model: an engine's fixed capacity (vocabulary, context, KV pool) as one frozen value built
when the engine starts; `check` raises the named `InvalidRequest` that a request breaks, so one bad
request is refused whole and never disturbs the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from actors.engine.errors import ContextLengthExceeded, EmptyPrompt, InvalidSamplingParams, TokenOutOfVocab
from actors.engine.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    num_blocks: int  # the engine's whole KV pool
    block_size: int

    def check(self, token_ids: Sequence[int], params: SamplingParams, num_output_tokens: int = 0) -> None:
        """`token_ids`: the prompt followed by the `num_output_tokens` already generated (a
        resumed request)."""
        if not token_ids:
            raise EmptyPrompt("prompt has no tokens")
        vocab = self.vocab_size
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
        if -(-total // self.block_size) > self.num_blocks:
            raise ContextLengthExceeded(
                f"prompt + max_tokens = {total} tokens needs more KV blocks than this engine holds "
                f"({self.num_blocks} blocks of {self.block_size})"
            )
        if num_output_tokens >= params.max_tokens:
            raise InvalidSamplingParams(
                f"{num_output_tokens} tokens already generated; max_tokens={params.max_tokens} leaves none to do")
