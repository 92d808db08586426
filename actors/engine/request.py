"""One request's life inside an engine: its tokens, progress, blocks' hashes and finish state.

`token_ids` is the prompt followed by every generated token; `num_computed_tokens` says how many of
them already have KV in the cache. Prefill, decode and recompute after preemption are all the same
operation: compute KV for `token_ids[num_computed_tokens:]`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from actors.engine.block_hash import BlockHash, hash_block
from actors.engine.block_hash import ROOT_HASH
from actors.engine.sampling import SamplingParams, SamplingState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_PREFILLED = "prefilled"  # prefill-only: the prompt's KV is computed and held

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_PREFILLED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingState
    block_size: int
    extra_keys: tuple[object, ...] = ()
    # Blocks that lie wholly inside the first `num_shared_prefix_tokens` tokens are hashed without
    # `extra_keys`: an opted-in shared prefix (a common system prompt) is shared across tenants,
    # everything after it stays salted.
    num_shared_prefix_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_prefix_hit_tokens: int = 0  # tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    hold_kv: bool = False  # keep blocks after finishing, until the engine's release_kv
    prefill_only: bool = False  # compute the prompt's KV, sample nothing
    # At most this many tokens of the prompt per step that also decodes other requests (None:
    # whatever the step budget leaves); a decode worker prefilling for itself keeps each step
    # within its rows' TPOT this way.
    max_chunk_tokens: int | None = None
    # 0 interactive, 1 batch: waiting requests of a smaller rank are admitted first.
    priority_rank: int = 0
    tenant: str = ""  # charged for the request's KV blocks (the engine's per-tenant shares)
    num_forwarded_tokens: int = 0  # every token this request ran through the model, recompute included
    # Resumed from saved KV: tokens from this position on are computed one per step, the way the
    # decode steps of the interrupted run computed them, so their KV (and what follows) has the
    # same bits. None: chunks as the budget allows.
    stepwise_from: int | None = None
    stop_reason: int | str | None = None
    speculation: bool = True  # may verify drafted tokens (spec/): False opts the request out
    tpot_target_s: float | None = None  # its TPOT target: short slack speculates first
    num_draft_tokens: int = 0  # drafted tokens verified for it so far
    num_accepted_tokens: int = 0  # of which accepted
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._update_block_hashes()

    @property
    def params(self) -> SamplingParams:
        return self.sampling.params

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.sampling.output_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        # Hash every block whose tokens are all known; the chain is extended, never recomputed.
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
            keys = () if (i + 1) * bs <= self.num_shared_prefix_tokens else self.extra_keys
            self.block_hashes.append(hash_block(parent, self.token_ids[i * bs : (i + 1) * bs], keys))
