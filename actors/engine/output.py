"""What the engine hands back: per-step deltas of tokens and text, and engine-wide stats.

Text is decoded incrementally (never broken UTF-8). Stop strings are matched on the decoded text and
cut exactly: the stop string and anything after it are never emitted. While streaming, a tail of
text that could still grow into a stop string is held back until it either does (and is dropped)
or cannot any more (and is emitted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from actors.engine.request import Request, RequestStatus
from actors.engine.sampling import TokenLogprobs
from actors.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    text: str  # all text emitted so far, new_text included
    token_ids: tuple[int, ...]  # all output tokens so far
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "prefilled"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_draft_tokens: int = 0  # speculative drafts verified for the request so far
    num_accepted_tokens: int = 0  # of which accepted
    time: float = field(default_factory=time.monotonic)

    def followed_by(self, later: "RequestOutput") -> "RequestOutput":
        """One delta covering this one and the `later` delta of the same request (streams that
        fall behind, or hold tokens back for a stream interval, send fewer, larger deltas)."""
        if later.request_id != self.request_id:
            raise ValueError(f"cannot merge outputs of {self.request_id} and {later.request_id}")
        return replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                       new_text=self.new_text + later.new_text, logprobs=self.logprobs + later.logprobs)


@dataclass(frozen=True)
class StepRecord:
    """One engine step's work and wall time, for a scheduler's step-time model. Decode rows are
    the single-token chunks after some context; every other chunk is prefill, its attention work
    counted as query-key pairs: new x (context before it + new / 2)."""

    num_prefill_tokens: int
    num_prefill_pairs: float
    num_decode_seqs: int
    num_context_tokens: int  # KV the decode rows read, their new token included
    step_s: float


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_free: int
    num_blocks_cached: int
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int
    num_preemptions: int
    num_evictions: int
    num_steps: int
    num_forwarded_tokens: int
    last_step_s: float
    num_offloads: int = 0  # preempted batch requests whose KV went to host memory (and came back)
    offloaded_bytes: int = 0  # host memory their KV takes now
    kv_blocks_by_tenant: tuple[tuple[str, int], ...] = ()  # blocks charged to each tenant (block_pool.py)
    spec_method: str = "off"  # speculative decoding (spec/): the proposer, and its totals
    num_spec_steps: int = 0  # steps in which rows verified drafts
    num_spec_rounds: int = 0  # rows that verified drafts, summed over those steps
    num_decode_rows: int = 0  # decode rows, speculating or not, summed over steps: (rows + accepted) / rows
    # is the output tokens per decode row-step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks_total - self.num_blocks_free


class _TextState:
    # The detokenizer's context is every token so far: a resumed request's first new text delta
    # must join the text already streamed elsewhere (leading spaces, split characters).
    def __init__(self, tokenizer: Tokenizer, req: Request) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, list(req.token_ids), skip_special_tokens=True)
        self.text = ""
        self.emitted = 0
        stops = req.params.stop
        self.stops = stops
        self.max_stop_len = max((len(s) for s in stops), default=0)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def add(self, req: Request) -> None:
        self._states[req.request_id] = _TextState(self.tokenizer, req)

    def on_token(
        self, req: Request, token_id: int, logprobs: TokenLogprobs | None, status: RequestStatus | None
    ) -> tuple[RequestOutput, RequestStatus | None]:
        """Decodes the token, applies stop strings; returns the output and the final status
        (a stop string can finish a request the token checks did not)."""
        st = self._states[req.request_id]
        delta = st.detok.push(token_id)
        if st.stops and delta:
            start = max(0, len(st.text) - st.max_stop_len + 1)
            st.text += delta
            hits = [(i, s) for s in st.stops if (i := st.text.find(s, start)) >= 0]
            if hits:
                cut, stop = min(hits)
                st.text = st.text[:cut]
                req.stop_reason = stop
                status = RequestStatus.FINISHED_STOPPED
        else:
            st.text += delta
        if status is None:
            end = len(st.text) - _held_back(st.text, st.stops, st.emitted)
        else:
            end = len(st.text)
        new_text = st.text[st.emitted : end]
        st.emitted = max(st.emitted, end)
        out = self._output(req, (token_id,), new_text, (logprobs,), status)
        if status is not None:
            del self._states[req.request_id]
        return out, status

    def finish(self, req: Request) -> RequestOutput:
        """Output of a request that ended without a token (abort, prefill-only)."""
        st = self._states.pop(req.request_id, None)
        text = st.text[: st.emitted] if st else ""
        return RequestOutput(
            request_id=req.request_id, new_token_ids=(), new_text="", text=text,
            token_ids=tuple(req.output_token_ids), finished=True, finish_reason=req.status.value,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_prefix_hit_tokens,
        )

    def _output(self, req, token_ids, new_text, logprobs, status) -> RequestOutput:  # type: ignore[no-untyped-def]
        st = self._states[req.request_id]
        finished = status is not None
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=token_ids,
            new_text=new_text,
            text=st.text[: st.emitted],
            token_ids=tuple(req.output_token_ids),
            logprobs=logprobs if req.params.logprobs is not None else (),
            finished=finished,
            finish_reason=status.value if finished else None,
            stop_reason=req.stop_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_prefix_hit_tokens,
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
        )


def _held_back(text: str, stops: tuple[str, ...], emitted: int) -> int:
    """Length of the longest tail of `text` (not yet emitted) that is a proper prefix of a stop
    string: it may still become a stop string with the next token."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text) - emitted), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
