"""The one YAML/dict config of a ferry deployment, validated at the boundary.

Pydantic with `extra="forbid"` everywhere, so a misspelt field is an error naming it; cross-field
checks live in `AppConfig._check`. Each component gets only its own section, converted to the
frozen dataclasses the core classes take (`to_worker_config`, `to_cache_config`).

Where engines run: `engine.device` auto means cuda when the Ray cluster has GPUs; `worker_resources`
turns that into what each worker asks Ray for (a GPU, a fraction of one, or a quarter CPU), and the
engine config follows it (device pinned, `kv_memory_share` = the part of its GPU or host that is
the engine's). The KV pool is planned from the memory left after the weights and a profiled step
(actors/engine/memory.py) unless `engine.kv_cache_mib` is given.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from actors.engine.config import EngineConfig
from actors.engine.paging import PagingPolicy
from actors.engine.spec import SpecConfig
from actors.engine.shares import TenantShares
from actors.node_roles import NodeRoles
from actors.prefix_cache.store import PrefixCacheConfig
from actors.worker_config import WorkerConfig, WorkerPolicies, WorkerResources, plan_worker_resources
from cluster.router.config import RouterConfig
from deploy.openai.config import ApiConfig
from transfer.config import TransferConfig

MIB = 1 << 20


class ConfigSection(BaseModel):
    """Base of every section of the app config (deploy/scheduler_config.py's too): an unknown field is
    an error naming it, and a validated section is frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PagingSection(ConfigSection):
    """Which free KV blocks a request's KV goes to (actors/engine/paging.py). Block hashes and prefix
    sharing are the same under every mode; bench/paging.py measures what each costs and buys."""

    mode: Literal["lazy", "request_aware"] = Field(
        "lazy", description="lazy: blocks from the free queue as needed; request_aware: long requests take "
                            "contiguous runs of block ids held ahead (faster CPU decode attention on their "
                            "rows), short ones the lazy blocks in id order")
    long_tokens: int = Field(1024, ge=1, description="prompt + max_tokens from which a request is long")
    run_blocks: int = Field(32, ge=1, description="blocks a long request holds ahead of its need")
    hard_holds: bool = Field(False, description="held blocks are reserved (true) or lent when the pool runs "
                                                "short (false: admits as lazy does)")

    def to_policy(self) -> PagingPolicy:
        return PagingPolicy(self.mode, self.long_tokens, self.run_blocks, self.hard_holds)


class SpeculationSection(ConfigSection):
    """Speculative decoding in the decode (and colocated) engines: a cheap proposer drafts a few
    tokens per row, one forward of the model verifies them all; greedy output is unchanged, seeded
    sampling stays reproducible. The engine decides per step which rows draft and how many (by
    their measured acceptance and TPOT slack; nothing when the batch is compute-bound)."""

    method: Literal["off", "ngram", "early_exit", "draft"] = Field(
        "ngram", description="ngram (the default: the engine drafts only where it pays); off; ngram, drafts looked up in the request's own tokens (prompt lookup: free, "
                           "pays on inputs that repeat: code edits, summaries, RAG); early_exit, the model's "
                           "first exit_layer layers draft; draft, a separate small model (draft_model) with "
                           "the same vocabulary drafts")
    max_draft_tokens: int = Field(4, ge=1, le=16, description="drafts per row and step at most")
    ngram_max: int = Field(4, ge=1, description="ngram: longest suffix looked up")
    ngram_min: int = Field(2, ge=1, description="ngram: shortest suffix looked up")
    exit_layer: int | None = Field(None, ge=1, description="early_exit: layers the draft runs (unset: half)")
    draft_model: str | None = Field(None, description="draft: known name, .gguf file or HF folder")
    sample_drafts: bool = Field(False, description="draft: sampled rows get sampled drafts, verified by "
                                                   "rejection sampling (else the draft's greedy tokens)")
    policy: Literal["auto", "always"] = Field(
        "auto", description="auto: each step drafts only where it pays (few rows, good acceptance, short TPOT "
                            "slack); always: every eligible row verifies max_draft_tokens (measuring, debugging)")

    @model_validator(mode="after")
    def _check(self) -> "SpeculationSection":
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) is above ngram_max ({self.ngram_max})")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("method draft needs draft_model (a known name, .gguf file or HF folder)")
        return self

    def to_spec_config(self) -> SpecConfig:
        return SpecConfig(method=self.method, max_draft_tokens=self.max_draft_tokens, ngram_max=self.ngram_max,
                          ngram_min=self.ngram_min, exit_layer=self.exit_layer, draft_model=self.draft_model,
                          sample_drafts=self.sample_drafts, policy=self.policy)


class EngineSection(ConfigSection):
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda when the Ray cluster has GPUs (each worker then asks Ray for one, or "
                            "a fraction), else cpu; cuda asks for GPUs even before a GPU node is up")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="float32, the default: the precision the model's weights dequantize to, so greedy "
                               "output is the float32 model's (what transformers computes); auto: bfloat16 on GPUs "
                               "and on CPUs with native bf16 (AVX512-BF16, AMX), else float32 - faster, and an "
                               "opt-in like a lossy KV codec: bf16 rounding changes some greedy tokens")
    kv_cache_dtype: Literal["auto", "int8"] = "auto"
    block_size: int = Field(16, gt=0)
    kv_cache_mib: int | None = Field(
        None, gt=0, description="KV block pool of each worker; unset: planned from the memory left after the "
                                "weights and a profiled step (kv_memory_fraction of it, this worker's share)")
    kv_memory_fraction: float = Field(0.9, gt=0, le=1, description="planned pool: the part of the memory left")
    kv_cache_max_mib: int = Field(2048, gt=0, description="CPU: the most a planned pool takes (RAM is shared "
                                                          "with the host's other processes)")
    num_gpus_per_worker: float | None = Field(
        None, gt=0, le=1, description="GPUs each worker asks Ray for; a fraction lets workers share one (a "
                                      "prefill and a decode worker at 0.5 each). Unset: one each while the "
                                      "cluster has a GPU per worker, else the workers packed evenly onto its GPUs")
    enforce_eager: bool = Field(False, description="CUDA: no CUDA graphs for decode steps")
    max_num_seqs: int = Field(32, gt=0)
    max_num_batched_tokens: int = Field(512, gt=0)
    max_model_len: int | None = Field(None, gt=0)
    enable_prefix_caching: bool = True
    prepack_weights: bool = Field(True, description="CPU: keep a oneDNN-packed copy of each projection weight "
                                                    "(faster decode GEMMs for one more copy of the weights)")
    cpu_cores: Literal["shared", "split"] = Field(
        "shared", description="CPU engines: shared, every engine runs on all the node's cores and sleeps "
                              "when idle (OMP_WAIT_POLICY=PASSIVE), so a busy prefill gets the cores an idle "
                              "decode leaves; split, each engine keeps an equal part of the cores")
    lend_cores: bool = Field(
        False, description="CPU engines sharing the cores (cpu_cores shared): while a prefill engine computes, "
                          "a decode engine on its node waits between steps as long as every row it runs is "
                          "ahead of its TPOT target, so the prompt gets all the cores (actors/core_share.py)")
    torch_threads: int | None = Field(
        None, gt=0, description="threads each worker's kernels use; default: all of this node's CPUs "
                                "(cpu_cores shared), or an equal split of them among the app's engines (split)")
    max_offload_mib: int = Field(
        1024, ge=0, description="host memory per worker for the KV of preempted batch-class requests: they "
                                "resume from it, nothing recomputed, when interactive work needed their "
                                "blocks; 0 turns offload off (they are recomputed)")
    speculation: SpeculationSection = SpeculationSection()
    kv_paging: PagingSection = PagingSection()


class TransferSection(ConfigSection):
    kind: Literal["auto", "nixl", "cuda_ipc", "object_store"] = Field(
        "auto", description="auto: cuda_ipc between GPU workers of a one-node cluster, else nixl where it "
                            "imports (device staging when the KV is on a GPU), else the Ray object store")
    compression: Literal["auto", "none", "zstd", "int8", "fp8"] = Field(
        "auto", description="KV on the wire: auto picks, per transfer, the codec predicted to deliver it soonest "
                            "(encode + wire + decode, from measured link bandwidth and codec costs) among those the "
                            "tenant's kv_fidelity allows (exact, the default: none or zstd, both bit-exact; lossy: "
                            "int8 and fp8 too); naming a codec forces it (a lossy one needs every tenant lossy). "
                            "A tenant's scheduler kv_compression wins")
    num_shards: int = Field(2, ge=1)
    staging_mib: int = Field(64, gt=0)
    timeout_s: float = Field(10.0, gt=0)
    lease_s: float = Field(30.0, gt=0)
    ucx_net_devices: str | None = Field("lo", description='"lo" keeps NIXL on loopback; a GPU cluster names its NICs')


class PrefixCacheSection(ConfigSection):
    num_stores: int = Field(1, ge=0, description="0 turns the prefix-cache pool off")
    dram_mib: int = Field(256, gt=0)
    disk_mib: int = Field(1024, ge=0)
    disk_dir: str | None = None
    compression: Literal["none", "zstd", "int8", "fp8"] = Field(
        "none", description="blocks in the pool: none or zstd (lossless) for every tenant; int8 / fp8 apply to "
                            "kv_fidelity lossy tenants' blocks only, an exact tenant's stay none")
    eviction: Literal["value", "lru"] = Field("value", description="value: blocks ranked by decayed reuse, recency "
                                              "and chain depth, admitted by it; lru: plain recency (the baseline)")


class PlacementSection(ConfigSection):
    """Which node type hosts each role, as a Ray custom resource its nodes declare (actors/node_roles.py;
    README: Many nodes). Unset: anywhere Ray has room (one node, or any of them)."""

    head: str | None = Field(None, description="ingress and scheduler, e.g. ferry_head")
    prefill: str | None = Field(None, description="prefill workers, e.g. ferry_prefill")
    decode: str | None = Field(None, description="decode (or colocated) workers, e.g. ferry_decode")
    cache: str | None = Field(None, description="prefix-cache store actors, e.g. ferry_cache")
    worker_share: float = Field(0.001, description="what each prefill/decode worker takes of its role's "
                                "resource: 0.001 only marks the nodes; 1 makes a node declaring ferry_decode: N "
                                "hold N decode workers (CPU-only node types; deploy/cluster-local.yaml)")

    @model_validator(mode="after")
    def _check(self) -> "PlacementSection":
        self.node_roles()  # names that are not custom resources are errors here
        return self

    def node_roles(self) -> NodeRoles:
        return NodeRoles(head=self.head, prefill=self.prefill, decode=self.decode, cache=self.cache,
                         worker_share=self.worker_share)


class AppConfig(ConfigSection):
    model: str = Field("smollm2", description="known name, .gguf file or HF folder")
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    num_prefill: int = Field(1, ge=1)
    num_decode: int = Field(1, ge=1)
    engine: EngineSection = EngineSection()
    transfer: TransferSection = TransferSection()
    prefix_cache: PrefixCacheSection = PrefixCacheSection()
    api: ApiConfig = ApiConfig(auth_required=False)
    placement: PlacementSection = PlacementSection()
    request_timeout_s: float = Field(120.0, gt=0, description="longest a request may wait between tokens")
    room_wait_s: float = Field(30.0, ge=0, description="a new request that finds every decode row taken waits for "
                                                       "one (interactive first) until nothing has moved for this long "
                                                       "(no row freed or streamed, no decode worker joined or coming), "
                                                       "then gets 429; 0: 429 at once")
    room_max_wait_s: float = Field(300.0, ge=0, description="the most a new request waits for a decode row in all, "
                                                            "in a queue that moves")
    stream_interval: int = Field(
        1, ge=1, description="tokens per streamed delta after the first: 1 sends every token; more sends fewer, "
                             "larger deltas (less CPU per token on the way to the client, same TTFT and TPOT, "
                             "coarser inter-token gaps)")
    loopback_only: bool = Field(True, description="bind every listener of ferry's own to 127.0.0.1 (local runs)")
    workers_as: Literal["actors", "deployments"] = Field(
        "deployments", description="deployments: prefill, decode (or colocated) workers are Serve deployments of "
                                   "their own (`serve status` lists them; Serve restarts dead replicas; the scheduler "
                                   "may scale them); actors: the ingress starts them as plain Ray actors")
    replace_dead_workers: bool = Field(
        True, description="start a fresh worker of the same kind and name when one dies; its streams resume "
                          "there when no other worker can take them")
    lend_prefill: bool = Field(
        True, description="with no decode worker up (a lone one died), its streams resume on a prefill worker "
                          "until one is back, instead of waiting for the replacement")

    @model_validator(mode="after")
    def _check(self) -> "AppConfig":
        if self.transfer.timeout_s >= self.transfer.lease_s:
            raise ValueError("transfer.timeout_s must be shorter than transfer.lease_s")
        if self.engine.device == "cpu" and self.engine.num_gpus_per_worker is not None:
            raise ValueError("engine.num_gpus_per_worker needs engine.device cuda or auto")
        return self

    @property
    def num_engines(self) -> int:
        """Engines this app runs: one per worker."""
        return self.num_decode if self.mode == "colocated" else self.num_prefill + self.num_decode

    def worker_resources(self, cluster_gpus: float) -> WorkerResources:
        """What each worker asks Ray for on a cluster with `cluster_gpus` GPUs now."""
        planned = plan_worker_resources(self.engine.device, self.num_engines, cluster_gpus,
                                        num_gpus_per_worker=self.engine.num_gpus_per_worker,
                                        share_cores=self.engine.cpu_cores == "shared",
                                        lend_cores=self.engine.lend_cores)
        return replace(planned, roles=self.placement.node_roles())

    def to_engine_config(self, resources: WorkerResources | None = None,
                         tenant_kv_shares: TenantShares | None = None) -> EngineConfig:
        """The engine of each worker. With `resources` (`worker_resources`) its device is the one Ray
        grants and a planned KV pool takes the worker's part of it: on a GPU the fraction it holds,
        on CPU an equal split of the host among the app's engines (as `torch_threads` is). Without,
        the device stays as configured (auto: cuda when this process sees one)."""
        e = self.engine
        on_gpu = resources.device == "cuda" if resources is not None else e.device == "cuda"
        share = (e.num_gpus_per_worker or 1.0) if on_gpu else 1.0 / self.num_engines
        engine = EngineConfig(
            device=e.device, dtype=e.dtype, block_size=e.block_size,
            kv_cache_bytes=None if e.kv_cache_mib is None else e.kv_cache_mib * MIB,
            kv_memory_fraction=e.kv_memory_fraction, kv_memory_share=share, kv_cpu_max_bytes=e.kv_cache_max_mib * MIB,
            enforce_eager=e.enforce_eager, max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens, max_model_len=e.max_model_len,
            kv_cache_dtype=e.kv_cache_dtype, enable_prefix_caching=e.enable_prefix_caching,
            prepack_weights=e.prepack_weights, max_offload_bytes=e.max_offload_mib * MIB,
            tenant_kv_shares=tenant_kv_shares or TenantShares(), speculation=e.speculation.to_spec_config(),
            kv_paging=e.kv_paging.to_policy(),
        )
        return engine if resources is None else resources.place(engine)

    def to_worker_config(self, resources: WorkerResources | None = None,
                         policies: WorkerPolicies | None = None) -> WorkerConfig:
        """`policies`: what the workers apply per tenant (the scheduler section's `worker_policies()`:
        KV codec and fidelity, shares of the engine's KV blocks); default: every tenant exact."""
        t = self.transfer
        staging = t.staging_mib * MIB
        policies = policies or WorkerPolicies()
        return WorkerConfig(
            model=self.model, engine=self.to_engine_config(resources, policies.tenant_kv_shares),
            transfer=TransferConfig(kind=t.kind, send_staging_bytes=staging, recv_staging_bytes=staging,
                                    ucx_net_devices=t.ucx_net_devices),
            compression=t.compression, tenant_kv=tuple(sorted(policies.tenant_kv.items())),
            default_tenant_kv=policies.default_tenant_kv, num_shards=t.num_shards,
            pool_compression=self.prefix_cache.compression,
            lease_s=t.lease_s, transfer_timeout_s=t.timeout_s, ucx_net_devices=t.ucx_net_devices,
            stream_interval=self.stream_interval, max_shadow_bytes=self.shadow_budget_bytes(),
        )

    def shadow_budget_bytes(self) -> int:
        """Each decode worker's KV shadows may take its share of half the prefix pool (DRAM and
        disk tiers), so shadows never crowd out more than half of the shared prefixes."""
        c = self.prefix_cache
        return max(1, c.num_stores * (c.dram_mib + c.disk_mib) * MIB // (2 * self.num_decode))

    def to_cache_config(self, tenant_shares: TenantShares | None = None) -> PrefixCacheConfig | None:
        """The prefix-cache stores' config; `tenant_shares`: the tenants' shares of each tier (the
        scheduler section's `kv_shares()`, the same fractions as of the engines' blocks)."""
        c = self.prefix_cache
        if c.num_stores == 0:
            return None
        return PrefixCacheConfig(dram_bytes=c.dram_mib * MIB, disk_bytes=max(c.disk_mib, 1) * MIB,
                                 disk_dir=c.disk_dir, enable_disk=c.disk_mib > 0, eviction=c.eviction,
                                 tenant_shares=tenant_shares or TenantShares())

    def to_router_config(self) -> RouterConfig:
        return RouterConfig(prefill_timeout_s=self.request_timeout_s, token_timeout_s=self.request_timeout_s,
                            room_wait_s=self.room_wait_s, room_max_wait_s=self.room_max_wait_s,
                            lend_prefill=self.lend_prefill)


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the bad fields."""


def load_config(source: str | Path | dict[str, Any] | None) -> AppConfig:
    """From a YAML file, a dict (Serve passes `args`), or None for the defaults. The `scheduler`
    section is validated by its own model (deploy/scheduler_config.py) in `build_app`."""
    data = dict(read_args(source))
    data.pop("scheduler", None)
    try:
        return AppConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"{_where(source)}: {problems}") from None


def _where(source: object) -> str:
    return "config" if source is None or isinstance(source, dict) else str(source)


def read_args(source: str | Path | dict[str, Any] | None) -> dict[str, Any]:
    """The app's args as a plain dict, unvalidated: from a ferry YAML, a Serve config file (the
    args of its deploy.apps application), a dict, or None."""
    where = _where(source)
    if source is None:
        data: Any = {}
    elif isinstance(source, dict):
        data = source
    else:
        where = str(source)
        try:
            data = yaml.safe_load(Path(source).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{where}: cannot read: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level, got {type(data).__name__}")
    if "applications" in data:  # a Serve config file: ferry's args live under its application
        apps = [a for a in data["applications"] or [] if str(a.get("import_path", "")).startswith("deploy.apps")]
        if len(apps) != 1:
            raise ConfigError(f"{where}: expected exactly one application with import_path deploy.apps:build_app")
        data = apps[0].get("args") or {}
    return data
