"""The `scheduler:` section of a ferry app's config: tenants, their SLOs and budgets, admission.

Pydantic with `extra="forbid"` at the boundary, converted to the frozen `cluster.config`
dataclasses the scheduler takes (`to_scheduler_config`) and the ingress's link settings
(`to_link_config`). Tenant names are the ones `api.api_keys` maps keys to. The defaults suit the
embedded CPU deployment (loose targets, so a laptop does not refuse everything); a GPU cluster
states real targets per tenant.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from actors.engine.shares import TenantShare, TenantShares
from actors.worker_config import TenantKVPolicy, WorkerPolicies
from cluster.admission import AdmissionConfig
from cluster.config import SchedulerConfig
from cluster.descriptors import TenantId
from cluster.router.link_config import LinkConfig
from cluster.placement import PlacementConfig
from cluster.scaling import RoleBounds, ScalingConfig
from cluster.tenants import BatchSlo, InteractiveSlo, TenantConfig
from deploy.config import ConfigSection
from deploy.dashboard.provider import StaticSlos
from deploy.openai.policy import PolicyBook, TenantRules


class TenantSection(ConfigSection):
    slo_class: Literal["interactive", "batch"] = "interactive"
    ttft_ms: float = Field(30_000.0, gt=0, description="interactive: P99 time to first token")
    tpot_ms: float = Field(1_000.0, gt=0, description="interactive: P99 mean time per output token")
    deadline_s: float = Field(3600.0, gt=0, description="batch: completion deadline after arrival")
    weight: float = Field(1.0, gt=0, description="share of the cluster under contention")
    max_tokens_per_s: float | None = Field(None, gt=0)
    burst_tokens: float | None = Field(None, gt=0)
    max_concurrency: int | None = Field(None, ge=1)
    queue_timeout_s: float = Field(30.0, gt=0)
    on_predicted_miss: Literal["shed", "queue"] = Field(
        "shed", description="a request predicted to miss its SLO (by slo_refuse_factor): shed, refused at once "
                            "with 429 slo_unattainable, its predicted wait and a Retry-After; queue, admitted "
                            "and served late, ordered by slack (queue_timeout_s still bounds its wait)")
    kv_recovery: Literal["shadow", "recompute"] = Field(
        "recompute", description="shadow: running requests copy their KV blocks to the prefix-cache pool as they "
                                 "fill, so a recovery or preemption resumes from them (identical output, ~1 s "
                                 "stall; costs decode and prefill time on shared CPU cores: see README); "
                                 "recompute: nothing is copied, a resume recomputes the prefix (may take another "
                                 "path in bf16)")

    kv_fidelity: Literal["exact", "lossy"] = Field(
        "exact", description="exact: every path this tenant's KV takes (prefill -> decode, prefix-cache pool, "
                             "shadows, offload, storage) is bit-exact, so greedy output is the model's own; lossy: "
                             "int8 / fp8 may be picked where predicted faster (README: KV fidelity gives what each "
                             "costs in greedy agreement and logprob drift)")
    kv_compression: Literal["auto", "none", "zstd", "int8", "fp8"] = Field(
        "auto", description="the KV handed from prefill to decode: auto, the transfer's codec is the one predicted "
                            "fastest among those kv_fidelity allows (transfer.compression decides when that is not "
                            "auto); none / zstd, always that lossless codec; int8 / fp8, always that lossy codec "
                            "(needs kv_fidelity: lossy)")

    speculation: Literal["off", "auto"] = Field(
        "auto", description="speculative decoding for this tenant's requests: auto, the decode engines draft "
                            "and verify tokens where it pays (engine.speculation says how; output unchanged); "
                            "off, never (a request's x-ferry-speculation: off also turns it off)")

    kv_share_guaranteed: float = Field(
        0.0, ge=0, le=1, description="part of every engine's KV blocks and of each prefix-pool tier that other "
                                     "tenants cannot take from this one while it uses no more: eviction and "
                                     "preemption take from tenants above their guarantee first")
    kv_share_max: float = Field(
        1.0, gt=0, le=1, description="the most of every engine's KV blocks (and of each pool tier) this tenant may "
                                     "hold; at it, its requests wait for its own blocks instead of evicting others'")

    @model_validator(mode="after")
    def _check_share(self) -> "TenantSection":
        if self.kv_share_guaranteed > self.kv_share_max:
            raise ValueError("kv_share_guaranteed is above kv_share_max")
        self.kv_policy()  # a lossy codec with kv_fidelity exact is refused here, by name
        return self

    def kv_policy(self) -> TenantKVPolicy:
        return TenantKVPolicy(self.kv_compression, self.kv_fidelity)

    def kv_share(self) -> TenantShare:
        return TenantShare(self.kv_share_guaranteed, self.kv_share_max)

    def to_tenant_config(self, name: str) -> TenantConfig:
        slo = (InteractiveSlo(self.ttft_ms, self.tpot_ms) if self.slo_class == "interactive"
               else BatchSlo(self.deadline_s))
        return TenantConfig(TenantId(name), weight=self.weight, slo=slo, max_tokens_per_s=self.max_tokens_per_s,
                            burst_tokens=self.burst_tokens, max_concurrency=self.max_concurrency,
                            queue_timeout_s=self.queue_timeout_s, shed_predicted_misses=self.on_predicted_miss == "shed")


class ScalingSection(ConfigSection):
    """Replica counts per role from measured slack (`workers_as: deployments` only): the scheduler
    advises, the ingress applies it to the worker deployments."""

    min_prefill: int = Field(1, ge=1)
    max_prefill: int = Field(1, ge=1)
    min_decode: int = Field(1, ge=1)
    max_decode: int = Field(1, ge=1)
    up_at: float = Field(0.8, gt=0, description="add a worker once the role's pressure (1: at its SLO) stays this high")
    down_at: float = Field(0.5, gt=0, description="remove one once the others would carry at most this pressure")
    up_delay_s: float = Field(2.0, ge=0)
    down_delay_s: float = Field(30.0, ge=0)

    def to_scaling_config(self) -> ScalingConfig:
        return ScalingConfig(RoleBounds(self.min_prefill, self.max_prefill), RoleBounds(self.min_decode, self.max_decode),
                             self.up_at, self.down_at, self.up_delay_s, self.down_delay_s)


class SchedulerSection(ConfigSection):
    enabled: bool = Field(True, description="false: place requests locally by load, no scheduler actor")
    tenants: dict[str, TenantSection] = Field(default_factory=dict)
    default_tenant: TenantSection | None = Field(
        TenantSection(), description="the contract of tenants not listed; null refuses them (403)")
    slo_admission: bool = True
    slo_refuse_factor: float = Field(2.0, ge=1.0, description="refuse when predicted to miss by this factor")
    fairness: bool = True
    local_prefill: bool = Field(
        False, description="a decode worker may prefill a request itself (and skip the KV handoff) when that "
                           "gives an earlier first token than the queued prefill workers, in chunks sized so "
                           "that its running rows keep their TPOT")
    preempt_batch: bool = Field(
        True, description="an interactive request that fits on no decode worker takes the rows of running "
                          "batch-class requests, which pause and resume from their tokens when a row frees")
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    batch_deadline_s: float = Field(3600.0, gt=0, description="deadline of requests downgraded to batch")
    admit_timeout_s: float = Field(2.0, gt=0, description="a placement decision; past it, placed locally")
    report_interval_s: float = Field(0.1, gt=0)
    actor_name: str = "ferry-scheduler"
    scaling: ScalingSection | None = Field(None, description="replica counts by slack; null: fixed counts")

    @model_validator(mode="after")
    def _check(self) -> "SchedulerSection":
        for name in self.tenants:
            if not name:
                raise ValueError("tenants: a tenant name is empty")
        self.kv_shares()  # the guarantees must fit in one store
        return self

    def kv_shares(self) -> TenantShares:
        """Each tenant's share of the engines' KV blocks and of the prefix-pool tiers; tenants not
        listed share the default tenant's (no guarantee, no ceiling when it is refused anyway)."""
        default = TenantShare() if self.default_tenant is None else self.default_tenant.kv_share()
        return TenantShares.of_mapping({n: t.kv_share() for n, t in self.tenants.items()}, default)

    def to_scheduler_config(self, max_num_seqs: int | None = None) -> SchedulerConfig:
        """`max_num_seqs`: the decode engines' row limit (the scheduler's own default otherwise)."""
        rows = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
        return SchedulerConfig(
            tenants=tuple(t.to_tenant_config(n) for n, t in sorted(self.tenants.items())),
            default_tenant=None if self.default_tenant is None else self.default_tenant.to_tenant_config("default"),
            admission=AdmissionConfig(slo_refuse_factor=self.slo_refuse_factor),
            heartbeat_timeout_s=self.heartbeat_timeout_s, batch_deadline_s=self.batch_deadline_s,
            slo_admission=self.slo_admission, fairness=self.fairness,
            scaling=None if self.scaling is None else self.scaling.to_scaling_config(),
            placement=PlacementConfig(local_prefill=self.local_prefill, preempt_batch=self.preempt_batch, **rows))

    def tenant_slos(self) -> StaticSlos:
        """The contracts the dashboard and `/health` measure attainment against: each listed tenant's,
        and the default tenant's for everyone else (as the scheduler applies them)."""
        default = None if self.default_tenant is None else self.default_tenant.to_tenant_config("default").slo
        return StaticSlos({name: t.to_tenant_config(name).slo for name, t in self.tenants.items()}, default)

    def request_policies(self) -> PolicyBook:
        """What each tenant's config says about every one of its requests (the Gate resolves a
        request's `RequestPolicy` from it and the headers): speculation, KV recovery. Unlisted
        tenants follow the default tenant (the defaults when that one is refused anyway)."""
        def rules(t: TenantSection) -> TenantRules:
            return TenantRules(speculation=t.speculation == "auto", kv_recovery=t.kv_recovery)

        default = TenantRules() if self.default_tenant is None else rules(self.default_tenant)
        return PolicyBook({n: rules(t) for n, t in self.tenants.items()}, default)

    def worker_policies(self) -> WorkerPolicies:
        """What workers apply per tenant (`AppConfig.to_worker_config`): each tenant's KV codec and
        fidelity (unlisted tenants the default tenant's; exact when they are refused anyway) and
        their shares of the engines' KV blocks."""
        default = TenantKVPolicy() if self.default_tenant is None else self.default_tenant.kv_policy()
        return WorkerPolicies({n: t.kv_policy() for n, t in self.tenants.items()}, default, self.kv_shares())

    def to_link_config(self, block_size: int) -> LinkConfig:
        return LinkConfig(admit_timeout_s=self.admit_timeout_s, report_interval_s=self.report_interval_s,
                          block_size=block_size)
