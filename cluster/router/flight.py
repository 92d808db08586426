"""The router's journal of one stream (`InFlight`), and what counts as a worker failure.

Mental model: the router is the one place that sees every token a client received,
so it keeps the journal: per request an `InFlight` with the tokens already streamed, the text
already sent, and where the request runs now. When a worker of the request dies (its actor
fails, its stream breaks, a deadline passes), the request is run again as a new *attempt* on a
healthy worker with `GenerationRequest(output_token_ids=streamed, seed=same)`: the engine
recomputes prompt + streamed tokens and continues the same sampling stream, so the client sees
the next token, never a repeated or a skipped one. Text needs one more step: the last tokens
streamed may not have produced their text yet (a character split across tokens is held back
until it completes), and an engine resuming after them would treat them as already shown. So a
resume starts after the last token whose text went out (`emitted_tokens`); the engine samples the
few after it again (same seed, same positions: the same ids, checked), and their events pass
through carrying only their text. Each attempt runs under its own worker-side id (`<id>~r<n>`),
so a late abort or a stale stream of an earlier attempt cannot touch a later one.

Recoveries are ordered in rounds: see cluster/router/rounds.py.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from actors.errors import (DataPlaneError, EngineDead, HandoffFailed, KVNotArrived, NoCapacity, UnknownRequest,
                           WorkerTimeout)
from actors.messages import GenerationRequest, TokenEvent
from cluster.router.choice import PlacementChoice
from cluster.router.handles import WorkerUnreachable
from transfer.transport import TransferError

# Phases of an attempt, as the router sees them. PREEMPTED: its decode row was taken for more
# urgent work; it holds no worker and waits to be placed again (`Router.preempt`).
PLACED, PREFILLING, DECODING, PREEMPTED = "placed", "prefilling", "decoding", "preempted"


class StreamBroken(DataPlaneError):
    """A worker's stream ended before its last event."""


class ReplayMismatch(StreamBroken):
    """A resumed stream sampled a token other than the one already streamed at that position."""


# What a dead or sick worker looks like to the router. Bad input (`InvalidRequest`), refusals
# and aborts are not in it: they would fail again anywhere.
_WORKER_FAILURES: tuple[type[BaseException], ...] = (
    WorkerUnreachable, WorkerTimeout, KVNotArrived, HandoffFailed, UnknownRequest, StreamBroken, TransferError,
    EngineDead,
)


def is_worker_failure(exc: BaseException, attempt: int) -> bool:
    """Whether `exc` means "run this request elsewhere". `NoCapacity` counts only for a recovery
    (a new request without room is refused instead)."""
    return isinstance(exc, _WORKER_FAILURES) or (attempt > 0 and isinstance(exc, NoCapacity))


@dataclass(eq=False)
class InFlight:
    """One request's journal entry in the router. Times are wall clock (`time.time()`)."""

    req: GenerationRequest
    streamed: list[int] = field(default_factory=list)
    text: str = ""  # text sent to the client so far
    prefill: str | None = None
    decode: str | None = None
    phase: str = PLACED
    attempt: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    issued: asyncio.Event = field(default_factory=asyncio.Event)
    issued_at: float | None = None
    num_failures: int = 0  # attempts lost to worker failures
    num_room_waits: int = 0  # recovery attempts that found no room
    room_deadline: float | None = None  # monotonic; set by the first of those
    emitted_tokens: int = 0  # leading tokens of `streamed` whose text has gone out
    num_preemptions: int = 0
    priority_rank: int = 0  # the current attempt's: 0 interactive, 1 batch
    resume_at: asyncio.Future[PlacementChoice] | None = None  # while preempted: where it runs next
    _text_base: str = ""
    _replay: list[int] = field(default_factory=list)  # streamed tokens the attempt samples again
    # Draft tokens (proposed, accepted) of the attempts before this one, and this one's running
    # totals: a worker counts its attempt only, the client's stream counts them all.
    _spec_base: tuple[int, int] = (0, 0)
    _spec: tuple[int, int] = (0, 0)

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def worker_request_id(self) -> str:
        return self.req.request_id if self.attempt == 0 else f"{self.req.request_id}~r{self.attempt}"

    def attempt_request(self) -> GenerationRequest:
        """What the current attempt sends to workers: the original request, or a resume."""
        if self.attempt == 0:
            return self.req
        return replace(self.resume_request(), request_id=self.worker_request_id)

    def resume_request(self) -> GenerationRequest:
        """The request a recovery runs: resumed after the tokens whose text went out."""
        done = self.streamed[: self.emitted_tokens]
        return replace(self.req, output_token_ids=tuple(done)) if done else self.req

    @property
    def spec_totals(self) -> tuple[int, int]:
        """Draft tokens (proposed, accepted) of every attempt so far."""
        return self._spec_base[0] + self._spec[0], self._spec_base[1] + self._spec[1]

    def touches(self, workers: frozenset[str]) -> bool:
        """Whether this request loses state if `workers` die: its decode worker always, its
        prefill worker until the KV has been delivered."""
        if self.decode in workers:
            return True
        return self.prefill in workers and self.phase in (PLACED, PREFILLING)

    def next_attempt(self) -> None:
        self.attempt += 1
        self._text_base = self.text
        self._replay = self.streamed[self.emitted_tokens:]
        self._spec_base, self._spec = self.spec_totals, (0, 0)
        self.issued.clear()
        self.issued_at = None

    def place(self, prefill: str | None, decode: str, phase: str) -> None:
        self.prefill, self.decode, self.phase = prefill, decode, phase
        self.resume_at = None

    def preempt(self) -> None:
        """Leave the workers (the router aborts the row): wait for `resume_at`."""
        self.prefill, self.decode, self.phase = None, None, PREEMPTED
        self.resume_at = asyncio.get_running_loop().create_future()
        self.num_preemptions += 1

    def mark_issued(self) -> None:
        self.issued_at = time.time()
        self.issued.set()

    def on_event(self, event: TokenEvent) -> TokenEvent | None:
        """Journals a streamed event and rewrites it to read as one stream: the client's request
        id, the text and the draft-token totals so far counted from the first attempt, and without
        the tokens sampled again (None when nothing is left to show)."""
        out = event.output
        new_ids, logprobs = out.new_token_ids, out.logprobs
        self._spec = (out.num_draft_tokens, out.num_accepted_tokens)
        if self._replay and new_ids:
            n = min(len(self._replay), len(new_ids))
            if tuple(self._replay[:n]) != tuple(new_ids[:n]):
                self.emitted_tokens = len(self.streamed)  # resume after all of them next time
                raise ReplayMismatch(f"{self.request_id}: resumed stream sampled {new_ids[:n]} where "
                                     f"{self._replay[:n]} was streamed")
            del self._replay[:n]
            new_ids, logprobs = new_ids[n:], logprobs[n:] if logprobs else logprobs
        if new_ids:
            now = event.emitted_at
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.streamed.extend(new_ids)
        if out.new_text or out.finished:
            self.emitted_tokens = len(out.token_ids)
        if self.attempt == 0:
            self.text = out.text
            return event
        if not new_ids and not out.new_text and not out.finished:
            return None
        drafts, accepted = self.spec_totals
        stitched = replace(out, request_id=self.req.request_id, new_token_ids=new_ids, logprobs=logprobs,
                           text=self._text_base + out.text, num_draft_tokens=drafts, num_accepted_tokens=accepted)
        self.text = stitched.text
        return replace(event, output=stitched)
