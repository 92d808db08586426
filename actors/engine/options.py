"""How one request is to run inside an engine, beyond its prompt and sampling parameters.

Mental model: `SamplingParams` say what to generate; `RequestOptions` say how the engine treats the
request while it does: what salts its block hashes, where it resumes, whether its KV outlives it,
how much of a step its prompt may take, how soon it is admitted. Callers build one per request
(a worker from `GenerationRequest.engine_options`) and hand it to `Engine.add_request` or
`AsyncEngine.generate`; the default, `RequestOptions()`, is a fresh interactive request.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOptions:
    # Go into every block hash (e.g. a tenant's cache salt): str, int or bytes only.
    extra_keys: tuple[object, ...] = ()
    # Blocks wholly inside the first `num_shared_prefix_tokens` tokens are hashed without
    # `extra_keys`: a system prompt shared across tenants on purpose.
    num_shared_prefix_tokens: int = 0
    # The engine's monotonic clock (None: when the engine takes the request).
    arrival_time: float | None = None
    # Resuming elsewhere (recovery, recompute): the tokens already streamed and the journaled
    # seed; the request continues exactly where it was. None seed: params.seed, else drawn.
    output_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # When the request finishes its blocks stay allocated until `Engine.release_kv` (a prefill
    # worker ships them first).
    hold_kv: bool = False
    # Compute the prompt's KV, sample nothing, finish as "prefilled" with the KV held (a prefill
    # worker's job). Implies `hold_kv`.
    prefill_only: bool = False
    # In steps that also decode other requests, compute at most this many of the prompt's tokens,
    # however much of the step budget is left, and no more than that with the other capped prompts
    # of the step together (a decode worker prefilling prompts between its rows' decode steps).
    # None: whatever the step budget leaves.
    max_chunk_tokens: int | None = None
    # 0 interactive, 1 batch: waiting requests of a smaller rank are admitted first, and a batch
    # request's KV may be offloaded to host memory to make room for interactive work.
    priority_rank: int = 0
    # Whose KV this is: the engine's per-tenant block shares (`EngineConfig.tenant_kv_shares`).
    tenant: str = ""
    # Speculative decoding (EngineConfig.speculation): False never speculates for this request
    # (`x-ferry-speculation: off`); `tpot_target_s` is its TPOT target, whose slack ranks the rows
    # that speculate (None: no target).
    speculation: bool = True
    tpot_target_s: float | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: normalise once, before anyone sees the object
        put(self, "extra_keys", tuple(self.extra_keys))
        put(self, "output_token_ids", tuple(int(t) for t in self.output_token_ids))
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {self.max_chunk_tokens}")

    @property
    def holds_kv(self) -> bool:
        """Whether the finished request's blocks are kept until `release_kv`."""
        return self.hold_kv or self.prefill_only
