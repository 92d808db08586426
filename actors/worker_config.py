"""Frozen configuration of the data-plane workers.

`WorkerConfig` is one section per worker process: which model, how its engine is sized, how KV
leaves it (transport kind, compression, shards) and the deadlines it keeps. `WorkerResources` is
what each worker actor asks Ray for, which decides where its engine runs (`plan_worker_resources`
turns a configured device into it). pydantic validation of user
input lives in deploy/; these only check invariants (the router's own settings: cluster/router/config.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from actors.core_share import CORE_SHARE_ENV, default_core_share_path
from actors.engine.config import EngineConfig
from actors.engine.shares import TenantShares
from actors.node_roles import NodeRoles, Role
from transfer.codec import Compression
from transfer.codec_choice import Fidelity, LossyCodecForExactTenant, allowed_codecs
from transfer.config import TransferConfig
from transfer.units import MIB

WORKER_NUM_CPUS = 0.25  # bookkeeping: 1 prefill + 1 decode + 1 cache actor fit on 2 cores
# libgomp (torch's OpenMP on CPU) reads this once, as the process starts: idle threads sleep at once
# instead of spinning. Engines that share a node's cores then take them in turn, not from each other.
SHARED_CORES_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass(frozen=True)
class WorkerConfig:
    model: str  # a known name ("smollm2"), a GGUF file or an HF folder
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(
        default_factory=lambda: TransferConfig(send_staging_bytes=64 * MIB, recv_staging_bytes=64 * MIB))
    # KV on the wire: auto (per transfer, the codec predicted fastest among those each tenant's
    # fidelity allows: transfer/codec_choice.py), or one codec for every transfer.
    compression: str = "auto"
    # Per-tenant KV policy (codec and fidelity); tenants not listed follow `default_tenant_kv`.
    tenant_kv: tuple[tuple[str, TenantKVPolicy], ...] = ()
    default_tenant_kv: TenantKVPolicy = field(default_factory=lambda: TenantKVPolicy())
    num_shards: int = 2  # layer groups per transfer (capped at the model's layer count)
    # Blocks offered to the prefix-cache pool: a lossy codec here applies to lossy tenants' blocks
    # only; an exact tenant's go as none (a lossless codec applies to everyone's).
    pool_compression: str = "none"
    lease_s: float = 30.0  # decode: announced KV must land within this, else the blocks are freed
    transfer_timeout_s: float = 10.0  # prefill: one send, all shards
    recv_poll_s: float = 0.05  # decode: receiver wake-up period (also the lease check period)
    pool_timeout_s: float = 2.0  # prefill: one pool fan-out; a slower store is a miss
    max_pending_offers: int = 64  # background pool offers (and KV shadows) beyond this wait or are dropped
    max_shadow_bytes: int = 512 * MIB  # decode: prefix-pool memory its running requests' KV shadows may hold
    shadow_keep_s: float = 600.0  # decode: an aborted request's KV shadows wait this long for its resume
    stream_interval: int = 1  # decode: tokens per streamed delta after the first (1 = every token)
    # Deprecated twin of `transfer.ucx_net_devices` (the transport's own setting, "lo" by default),
    # kept while deploy/config.py still passes it; when set it is applied first and so wins.
    ucx_net_devices: str | None = None

    def __post_init__(self) -> None:
        allowed_codecs(self.compression, "lossy")
        for tenant, policy in (("(default)", self.default_tenant_kv), *self.tenant_kv):
            try:
                self.codecs_for_policy(policy)
            except LossyCodecForExactTenant as e:
                raise LossyCodecForExactTenant(f"tenant {tenant}: {e}") from None
            if policy.fidelity == "exact" and self.engine.kv_cache_dtype != "auto":
                raise LossyCodecForExactTenant(
                    f"tenant {tenant}: engine.kv_cache_dtype {self.engine.kv_cache_dtype} stores every tenant's KV "
                    "lossily, but this tenant's kv_fidelity is exact; set kv_fidelity: lossy on every tenant "
                    "(the default tenant too) to opt in")
        Compression.parse(self.pool_compression)
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if self.shadow_keep_s < 0 or self.max_shadow_bytes < 0:
            raise ValueError("shadow_keep_s and max_shadow_bytes must be >= 0")
        for name in ("lease_s", "transfer_timeout_s", "recv_poll_s", "pool_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.transfer_timeout_s >= self.lease_s:
            # a send that is still allowed to finish after the receiver gave up would be wasted
            raise ValueError("transfer_timeout_s must be shorter than lease_s")

    @cached_property
    def _tenant_kv(self) -> dict[str, TenantKVPolicy]:  # looked up on every handoff and pool offer
        return dict(self.tenant_kv)

    def kv_policy(self, tenant: str) -> TenantKVPolicy:
        return self._tenant_kv.get(tenant, self.default_tenant_kv)

    def codecs_for_policy(self, policy: TenantKVPolicy) -> tuple[Compression, ...]:
        return allowed_codecs(self.compression if policy.compression == "auto" else policy.compression,
                              policy.fidelity)

    def codecs_for(self, tenant: str) -> tuple[Compression, ...]:
        """The codecs a transfer of `tenant`'s KV may use: the tenant's own codec when it names one,
        else the worker's `compression`, within what the tenant's fidelity allows (exact: lossless)."""
        return self.codecs_for_policy(self.kv_policy(tenant))

    def exact_kv(self, tenant: str) -> bool:
        """Whether `tenant`'s KV fidelity is exact (the default)."""
        return self.kv_policy(tenant).fidelity == "exact"

    def pool_codec_for(self, tenant: str) -> str:
        """The codec `tenant`'s blocks enter the prefix-cache pool with."""
        lossy = not self.exact_kv(tenant)
        return self.pool_compression if lossy or Compression.parse(self.pool_compression).lossless else "none"


@dataclass(frozen=True)
class TenantKVPolicy:
    """How one tenant's KV may be stored and moved. `fidelity` exact (the default): every path the
    KV takes (P->D wire, prefix-cache pool, shadows, offload, storage) is bit-exact, so its greedy
    tokens are the model's; lossy: int8/fp8 codecs may be chosen where predicted faster.
    `compression`: auto (the prediction decides among the allowed codecs) or one codec's name."""

    compression: str = "auto"
    fidelity: Fidelity = "exact"

    def __post_init__(self) -> None:
        allowed_codecs(self.compression, self.fidelity)


@dataclass(frozen=True)
class WorkerPolicies:
    """What the workers apply per tenant (the scheduler section's tenants, resolved once)."""

    tenant_kv: Mapping[str, TenantKVPolicy] = field(default_factory=dict)
    default_tenant_kv: TenantKVPolicy = field(default_factory=TenantKVPolicy)
    tenant_kv_shares: TenantShares = field(default_factory=TenantShares)


class NoGpuForWorker(ValueError):
    """A worker is configured for a GPU that the configuration itself rules out."""


@dataclass(frozen=True)
class WorkerResources:
    """What each worker actor asks Ray for, and so where its engine runs. `num_gpus` > 0: the engine
    runs on cuda, which inside the actor is the GPU Ray assigned it (Ray sets CUDA_VISIBLE_DEVICES);
    a fraction lets workers share one GPU (a prefill and a decode worker at 0.5 each). 0: the CPU.
    CPUs are fractional bookkeeping either way; `torch_threads` decides the cores a CPU engine uses.
    `share_cores`: the node's CPU engines each run on all its cores (`torch_threads` = the node's
    CPUs), so a busy engine gets the cores an idle one leaves; their OpenMP threads then sleep when
    idle (`SHARED_CORES_ENV`), or two busy engines would spin on each other's cores."""

    num_cpus: float = WORKER_NUM_CPUS
    num_gpus: float = 0.0
    share_cores: bool = False
    lend_cores: bool = False  # with share_cores: decode engines yield to a node's prefill by SLO slack
    roles: NodeRoles = field(default_factory=NodeRoles)  # which nodes each worker role may run on

    def __post_init__(self) -> None:
        if self.num_cpus < 0:
            raise ValueError(f"num_cpus must be >= 0, got {self.num_cpus}")
        if not 0 <= self.num_gpus <= 1:  # an engine drives one device
            raise ValueError(f"num_gpus must be in [0, 1], got {self.num_gpus}")

    @property
    def device(self) -> str:
        return "cuda" if self.num_gpus > 0 else "cpu"

    def actor_options(self, role: Role | None = None) -> dict[str, Any]:
        """Keyword arguments of `RemoteX.options(...)` for one worker actor; with `role`, kept on the
        nodes of that role (`roles`)."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if role is not None:
            options.update(self.roles.options(role))
        if self.share_cores:  # and, with lend_cores, lend them to each other by SLO slack (core_share.py)
            lend = {CORE_SHARE_ENV: default_core_share_path()} if self.lend_cores else {}
            options["runtime_env"] = {"env_vars": {**SHARED_CORES_ENV, **lend}}
        return options

    def place(self, engine: EngineConfig) -> EngineConfig:
        """`engine` as it must run under these resources: an "auto" device pinned to the one Ray
        grants (Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone in an actor without GPUs, so an engine
        left on auto there would take a GPU Ray gave another worker), and on a fractional GPU a
        planned KV pool that takes at most this worker's fraction of it. Idempotent."""
        if engine.device == "auto":
            engine = replace(engine, device=self.device)
        elif (engine.device == "cpu") != (self.device == "cpu"):
            raise NoGpuForWorker(f"the engine's device is {engine.device!r} but the worker asks Ray for "
                                 f"{self.num_gpus:g} GPUs")
        if self.num_gpus > 0 and engine.kv_memory_share > self.num_gpus:
            engine = replace(engine, kv_memory_share=self.num_gpus)
        return engine


def plan_worker_resources(device: str, num_workers: int, cluster_gpus: float, *,
                          num_gpus_per_worker: float | None = None,
                          num_cpus: float = WORKER_NUM_CPUS, share_cores: bool = False,
                          lend_cores: bool = False) -> WorkerResources:
    """Resources for each of `num_workers` workers whose engines are configured for `device`:
    "cpu"; "cuda" (or "cuda:N"), which asks for GPUs even when the cluster has none yet (an
    autoscaler starts a GPU node for the pending actors); or "auto", cuda when the cluster has GPUs
    now (`cluster_gpus`, its `GPU` resource total). Each worker gets `num_gpus_per_worker`, or by
    default a whole GPU while the cluster has one for every worker, else an equal fraction that
    packs them onto its GPUs (1 GPU, 2 workers: 0.5 each). `share_cores` applies to CPU workers only
    (`WorkerResources.share_cores`)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if device == "cpu" or (device == "auto" and cluster_gpus <= 0):
        if num_gpus_per_worker is not None:
            raise NoGpuForWorker(f"num_gpus_per_worker={num_gpus_per_worker:g} with device {device!r} and "
                                 f"{cluster_gpus:g} GPUs in the Ray cluster (device cuda waits for a GPU node)")
        return WorkerResources(num_cpus=num_cpus, share_cores=share_cores, lend_cores=lend_cores)
    if num_gpus_per_worker is not None:
        return WorkerResources(num_cpus=num_cpus, num_gpus=num_gpus_per_worker)
    whole_gpus = math.floor(cluster_gpus)
    if whole_gpus >= num_workers or whole_gpus == 0:  # none up yet: one each, for the autoscaler
        return WorkerResources(num_cpus=num_cpus, num_gpus=1.0)
    per_gpu = math.ceil(num_workers / whole_gpus)  # a fraction must fit on one GPU: pack, never spread
    return WorkerResources(num_cpus=num_cpus, num_gpus=math.floor(1e4 / per_gpu) / 1e4)  # Ray's 1e-4 grain
