"""One simulated request: its trace facts and everything that happens to it.

Mental model: the request object is shared by every simulated component; `state` says where it
is, and `epoch` increases whenever it is lost (its instance died), so events scheduled for an
older incarnation (a KV transfer in flight, say) recognise themselves as stale and do nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


# States, in the order a request normally passes them.
QUEUED, PREFILLING, TRANSFER, DECODE_WAIT, DECODING, DONE = (
    "queued", "prefilling", "transfer", "decode_wait", "decoding", "done")
LOST = "lost"  # its KV died with an instance: recompute prompt + generated tokens
ORPHAN = "orphan"  # its KV reached a dead decoder; the prefill side still holds it: re-send
REFUSED, CANCELLED, PREEMPTED = "refused", "cancelled", "preempted"


@dataclass(eq=False, slots=True)
class SimRequest:
    rid: str
    tenant: str
    arrival: float
    prompt_len: int
    out_len: int
    hashes: tuple[int, ...]
    interactive: bool = True
    state: str = QUEUED
    key: tuple = ()
    epoch: int = 0
    generated: int = 0  # output tokens emitted so far (the first one comes from prefill)
    first_token_t: float | None = None
    finish_t: float | None = None
    refusal: str | None = None
    prefill_inst: str | None = None
    decode_inst: str | None = None
    # prefill progress of the current incarnation
    pf_started: bool = False
    pf_total: int = 0
    pf_done: int = 0
    pf_cached: int = 0
    num_cached_tokens: int = 0  # over all incarnations, for the prefix-hit figure
    # decode bookkeeping (see instances.py)
    join_step: int = 0
    gen_at_join: int = 0
    s_term: int = 0
    blocks: int = 0
    # failures
    affected_at: float | None = None
    resume_t: float | None = None
    num_losses: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_t is None else self.first_token_t - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish_t is None or self.first_token_t is None:
            return None
        return 0.0 if self.out_len <= 1 else (self.finish_t - self.first_token_t) / (self.out_len - 1)

    def reset_prefill(self) -> None:
        self.pf_started, self.pf_total, self.pf_done, self.pf_cached = False, 0, 0, 0
