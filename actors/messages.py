"""What crosses actor calls in the data plane: a request, a prefill's report, a worker's load, a token.

Mental model: these are the envelopes of one disaggregated request. The caller builds a
`GenerationRequest` once (everything the engines need, the seed already resolved so the request can
be journaled and resumed anywhere); the decode worker and the prefill worker both receive it; the
prefill worker answers with a `PrefillResult` (what it reused, computed and shipped, and how long
each stage took); the decode worker streams `TokenEvent`s. `WorkerLoad` is what a placement policy
(and the cluster scheduler) reads, with the engine's KV plan for operators; `Telemetry` is what a
worker's engine measured since a cursor (step times, prefix blocks gained and lost), for the
scheduler's cost models and prefix index. Ray pickles them, so they hold plain fields only: ints,
floats, strings, tuples, and the engine's own frozen `SamplingParams` / `RequestOutput` / `KVPlan`.

Timestamps that leave a process are wall-clock (`time.time()`): monotonic clocks of two machines
share no origin.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from actors.engine.options import RequestOptions
from actors.engine.output import RequestOutput, StepRecord
from actors.engine.sampling import SamplingParams
from actors.kinds import WorkerKind

if TYPE_CHECKING:
    from actors.engine.memory import KVPlan

CacheKey = str | int | bytes  # what the engine's block hashes accept as extra keys


def tenant_cache_salt(tenant: str) -> tuple[CacheKey, ...]:
    """Default block-hash salt: equal prompts of two tenants never share KV blocks."""
    return (f"tenant:{tenant}",)


def draw_seed(request_id: str) -> int:
    """A seed that is a pure function of the request id: a retried request samples the same way."""
    return int.from_bytes(hashlib.sha256(b"seed:" + request_id.encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    tenant: str = "default"
    # None: params.seed, else derived from the request id. Resolved here, not by an engine, so the
    # decode engine, a resumed copy and the recovery journal all agree on it.
    seed: int | None = None
    # None: the tenant's salt (isolation by default). () opts the whole prompt into sharing.
    cache_salt: tuple[CacheKey, ...] | None = None
    # Leading tokens hashed without the salt: a system prompt shared across tenants on purpose.
    num_shared_prefix_tokens: int = 0
    output_token_ids: tuple[int, ...] = ()  # already streamed elsewhere: resume after them
    arrival_time: float = field(default_factory=time.time)
    # Prompt tokens per engine step at most (None: the engine's budget). Set for one attempt when
    # the scheduler has a decode worker prefill for itself, sized to its rows' TPOT room.
    max_chunk_tokens: int | None = None
    # 0 interactive, 1 batch: engines admit waiting requests of a smaller rank first. Set from the
    # placement's priority (the scheduler knows the request's SLO class).
    priority_rank: int = 0
    # The secret that keys this request's KV shadows in the prefix-cache pool (`kv_shadow.py`):
    # set by the router, the same for every attempt, so a resume finds the blocks an earlier one
    # saved and nobody else can. None: not shadowed (a recovery recomputes).
    shadow_salt: str | None = None
    # False: the engine never speculates for it (the caller's `x-ferry-speculation: off`, or its
    # tenant's `speculation: off`). `tpot_target_s`: its TPOT target, set from the placement (the
    # tenant's SLO); the engine speculates first for rows short of TPOT slack. None: no target.
    speculation: bool = True
    tpot_target_s: float | None = None
    # MoE models: experts per layer its generated tokens may use, chosen from its prompt's routing
    # (the caller's `x-ferry-expert-budget`; actors/moe_handoff.py). None: its tenant's budget, if any.
    expert_budget: int | None = None
    # None: its tenant's SLO class; "batch": the caller downgraded it (`x-ferry-slo-class: batch`).
    slo_class: Literal["batch"] | None = None

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: normalise once, before anyone sees the object
        put(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        put(self, "output_token_ids", tuple(int(t) for t in self.output_token_ids))
        if self.seed is None:
            put(self, "seed", self.params.seed if self.params.seed is not None else draw_seed(self.request_id))
        if self.cache_salt is None:
            put(self, "cache_salt", tenant_cache_salt(self.tenant))
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        if self.num_shared_prefix_tokens < 0:
            raise ValueError("num_shared_prefix_tokens must be >= 0")
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ValueError("max_chunk_tokens must be >= 1")
        if self.tpot_target_s is not None and not self.tpot_target_s > 0:
            raise ValueError("tpot_target_s must be positive")
        if self.expert_budget is not None and self.expert_budget < 1:
            raise ValueError("expert_budget must be >= 1")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_handoff(self) -> bool:
        """False for what a decode worker runs alone: a 1-token prompt has no KV to hand over
        (its only token is recomputed by the first decode), and a resume recomputes its tokens."""
        return self.num_prompt_tokens >= 2 and not self.output_token_ids

    def engine_options(self, *, prefill_only: bool = False) -> RequestOptions:
        """How an engine runs this request (`Engine.add_request` / `AsyncEngine.generate`): whole,
        on a decode or colocated worker; or with `prefill_only`, just its prompt's KV at the
        engine's full step budget, on a prefill worker. `arrival_time` stays here: it is wall
        clock, the engine's is monotonic."""
        return RequestOptions(
            extra_keys=self.cache_salt or (),
            num_shared_prefix_tokens=self.num_shared_prefix_tokens,
            output_token_ids=self.output_token_ids,
            seed=self.seed,
            prefill_only=prefill_only,
            max_chunk_tokens=None if prefill_only else self.max_chunk_tokens,
            priority_rank=self.priority_rank,
            tenant=self.tenant,
            speculation=self.speculation,
            tpot_target_s=self.tpot_target_s,
        )


@dataclass(frozen=True)
class RequestPolicy:
    """How one request is served, resolved once at the ingress from its tenant's settings and the
    caller's headers (`deploy/openai/policy.py`) and written into its `GenerationRequest`
    (`request`), which carries it to the router, the scheduler and the workers. What the tenant
    alone decides on the workers (its KV codec and fidelity, its KV shares) is looked up there by
    `tenant` from one `WorkerConfig`."""

    tenant: str = "default"
    slo_class: Literal["batch"] | None = None  # None: the tenant's class; "batch": downgraded by the caller
    speculation: bool = True  # False: the caller (`x-ferry-speculation: off`) or the tenant said off
    expert_budget: int | None = None  # MoE models: `x-ferry-expert-budget`
    kv_recovery: Literal["shadow", "recompute"] = "recompute"  # the tenant's: shadow KV to the pool, or recompute

    def request(self, request_id: str, prompt_token_ids: tuple[int, ...] | list[int], params: SamplingParams,
                arrival_time: float | None = None) -> GenerationRequest:
        """The request this policy runs; a shadowed one gets the secret key of its KV shadows here
        (every attempt reuses it)."""
        shadow = secrets.token_hex(16) if self.kv_recovery == "shadow" else None
        return GenerationRequest(request_id, tuple(prompt_token_ids), params, tenant=self.tenant,
                                 arrival_time=time.time() if arrival_time is None else arrival_time,
                                 slo_class=self.slo_class, speculation=self.speculation,
                                 expert_budget=self.expert_budget, shadow_salt=shadow)


@dataclass(frozen=True)
class PrefillResult:
    """What one prefill did. Block counts are full blocks of the prompt; times are seconds."""

    request_id: str
    worker: str
    num_prompt_tokens: int
    num_computed_tokens: int  # tokens this prefill ran through the model
    num_local_hit_blocks: int  # found in the prefill engine's own prefix cache
    num_pool_hit_blocks: int  # fetched from the prefix-cache pool and imported
    num_kv_blocks: int  # blocks shipped to the decode worker
    kv_raw_bytes: int  # their KV before compression
    kv_wire_bytes: int  # as sent: compressed, with shard headers
    num_shards: int
    queued_s: float  # arrival -> this worker started on it
    lookup_s: float  # local + pool prefix lookup, pool fetch and import
    compute_s: float  # the prefill-only engine run
    transfer_s: float  # read blocks, encode, send until the receiver holds every shard
    finished_at: float  # wall clock
    # The transfer's codec (transfer/codec_choice.py): which, why (forced by policy, predicted
    # fastest, or exploring), the encode + wire + decode seconds predicted for it and for every
    # codec the policy allowed, and the actual: encode and send measured, decode as predicted (the
    # receiver decodes after the send returns; its own figure is in its `ReceiverStats`).
    kv_codec: str = "none"
    kv_codec_reason: str = "forced"
    kv_codec_predicted_s: float = 0.0
    kv_codec_actual_s: float = 0.0
    kv_encode_s: float = 0.0
    kv_send_s: float = 0.0
    kv_codec_predictions: tuple[tuple[str, float], ...] = ()
    kv_fidelity: str = "exact"  # the tenant's KV fidelity, which bounded the codecs allowed
    # MoE models, a request with an expert budget: the experts per layer chosen from its prompt
    # here and sent to the decode worker ahead of the KV (actors/moe_handoff.py); None otherwise.
    expert_choice: tuple[tuple[int, ...], ...] | None = None


def spec_report(method: str, num_draft_tokens: int, num_accepted_tokens: int, num_spec_rounds: int) -> dict[str, object]:
    """An engine's speculative decoding as JSON-able figures (`/health`): its method, cumulative
    draft tokens proposed and accepted, steps that verified drafts, and the acceptance rate."""
    rate = round(num_accepted_tokens / num_draft_tokens, 4) if num_draft_tokens else None
    return {"method": method, "draft_tokens": num_draft_tokens, "accepted_tokens": num_accepted_tokens,
            "spec_rounds": num_spec_rounds, "acceptance_rate": rate}


def mib_or_none(num_bytes: int) -> int | None:
    """Whole MiB for reports; None for 0, which means "not known" for a process's memory."""
    return round(num_bytes / (1 << 20)) or None


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as the scheduler sees it."""

    name: str
    kind: WorkerKind
    num_running: int
    num_waiting: int
    num_reserved: int  # decode: announced requests whose KV has not landed yet
    num_free_blocks: int
    num_total_blocks: int
    last_step_s: float
    healthy: bool
    rss_bytes: int = 0  # resident memory of the worker's process; 0 where unknown
    kv_plan: KVPlan | None = None  # how the engine's KV pool was sized (fixed at start); None where unknown
    shadow_bytes: int = 0  # prefix-pool memory its running requests' KV shadows hold (kv_shadow.py)
    # Engine KV blocks charged to each tenant (in use, plus free ones holding its cached prefixes)
    kv_blocks_by_tenant: tuple[tuple[str, int], ...] = ()
    offloaded_bytes: int = 0  # host memory the KV of preempted batch requests takes (engine offload)
    # Speculative decoding (`EngineConfig.speculation`): the method, and the engine's cumulative
    # draft tokens proposed and accepted, rows that verified drafts (one per row and step), and
    # decode rows (one per row and step, speculating or not), since it started.
    spec_method: str = "off"
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_rounds: int = 0
    num_decode_rows: int = 0
    # Measured wall seconds per block the worker fetched from the prefix-cache pool, smoothed
    # (`PoolLink.fetch_s_per_block`); None where unknown: no pool, or no fetch has returned blocks yet.
    pool_fetch_s_per_block: float | None = None
    # Seconds a decode engine waited between steps, lending the node's cores to a prefill
    # (`engine.cpu_cores: shared`, actors/core_share.py), since it started.
    cores_lent_s: float = 0.0
    node: str = ""  # the Ray node id it runs on; "" where unknown (not in a Ray worker)

    @property
    def rss_mib(self) -> int | None:
        return mib_or_none(self.rss_bytes)

    def kv_plan_report(self) -> dict[str, object] | None:
        """The KV plan as JSON-able figures (`KVPlan.to_dict`), for `/health` and metrics."""
        return None if self.kv_plan is None else self.kv_plan.to_dict()

    @property
    def num_active(self) -> int:
        return self.num_running + self.num_waiting + self.num_reserved

    @property
    def spec_acceptance(self) -> float | None:
        """Accepted over proposed draft tokens since the engine started; None before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def spec_report(self) -> dict[str, object]:
        """Speculation as JSON-able figures, for `/health`."""
        return spec_report(self.spec_method, self.num_draft_tokens, self.num_accepted_tokens, self.num_spec_rounds)


@dataclass(frozen=True)
class TelemetryCursor:
    """How far a reader has taken a worker's telemetry: the worker process (`incarnation`), its
    last step and its last prefix-cache change applied."""

    incarnation: str
    step_seq: int
    cache_seq: int


@dataclass(frozen=True)
class Telemetry:
    """A worker's engine steps and prefix-cache changes after a cursor. Steps are numbered from
    `first_step_seq`; each cache change is (seq, hashes added, hashes removed). When the cursor is
    missing, of another incarnation, or older than the changes kept, `cached_full` carries every
    hash held instead, at `cache_seq`."""

    name: str
    incarnation: str
    first_step_seq: int
    steps: tuple[StepRecord, ...]
    cache_seq: int
    cache_changes: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    cached_full: frozenset[int] | None = None

    @property
    def cursor(self) -> TelemetryCursor:
        return TelemetryCursor(self.incarnation, self.first_step_seq + len(self.steps) - 1, self.cache_seq)


@dataclass(frozen=True)
class TokenEvent:
    """One streamed delta (usually one token) and when its worker produced it (wall clock)."""

    output: RequestOutput
    emitted_at: float
    worker: str

    @classmethod
    def of(cls, output: RequestOutput, worker: str) -> "TokenEvent":
        # RequestOutput.time is the engine's monotonic clock: shift it onto the wall clock.
        return cls(output, time.time() - (time.monotonic() - output.time), worker)
