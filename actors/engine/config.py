"""Frozen descriptions of a model and of an engine.

`ModelConfig` is what the weight loaders produce (from a GGUF file's metadata or an HF
config.json) and what the model is built from; `EngineConfig` sizes the block pool and the
scheduler. Both are plain frozen dataclasses: the pydantic boundary lives in deploy/.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from actors.engine.paging import PagingPolicy
from actors.engine.shares import TenantShares
from actors.engine.spec.config import SpecConfig
from transfer.units import GIB

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        raise ValueError('dtype "auto" is resolved per device first (EngineConfig.resolved)')
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose auto or one of {sorted(_DTYPES)}") from None


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """AVX512-BF16 or AMX-BF16: the CPUs on which bfloat16 GEMMs beat float32 ones. Elsewhere
    (AVX2, plain AVX-512) oneDNN converts every bf16 operand: measured 3.5x slower than float32 on
    an AVX2 box (SmolLM2, 512-token prefill: 35 vs 119 tokens/s, 2 threads)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def auto_dtype(device: torch.device) -> str:
    """bfloat16 on CUDA and on CPUs with native bf16 arithmetic, float32 on other CPUs."""
    return "bfloat16" if device.type == "cuda" or cpu_has_native_bf16() else "float32"


@dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling` fields. `rope_type` is "default", "linear" or "llama3"."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "RopeScaling":
        if not d:
            return cls()
        rope_type = d.get("rope_type", d.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling type {rope_type!r} (default, linear, llama3)")
        return cls(
            rope_type=rope_type,
            factor=float(d.get("factor", 1.0)),
            low_freq_factor=float(d.get("low_freq_factor", 1.0)),
            high_freq_factor=float(d.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(d.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family model (dense, or Mixtral-style MoE when num_experts > 0)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "GQA needs num_heads % num_kv_heads == 0"
        assert self.num_experts == 0 or 0 < self.num_experts_per_tok <= self.num_experts

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "model") -> "ModelConfig":
        """Reads a `config.json` of LlamaForCausalLM or MixtralForCausalLM."""
        archs = cfg.get("architectures") or []
        if archs and not any(a in ("LlamaForCausalLM", "MixtralForCausalLM", "MistralForCausalLM") for a in archs):
            raise ValueError(f"unsupported architecture {archs}; ferry serves Llama and Mixtral layouts")
        num_heads = int(cfg["num_attention_heads"])
        # transformers 5 nests rope fields under `rope_parameters`; older files use top-level
        # `rope_theta` and `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_scaling = cfg.get("rope_scaling") or rope
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=RopeScaling.from_dict(rope_scaling),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            num_experts=int(cfg.get("num_local_experts", 0) or 0),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of one engine: its KV block pool and its per-step budgets."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_bytes, or planned (actors/engine/memory.py)
    kv_cache_bytes: int | None = None  # None: planned from the memory left after weights and a profiled step
    # Planning (kv_cache_bytes and num_blocks unset): the pool takes `kv_memory_fraction` of the memory left
    # once the weights are loaded and a forward of `max_num_batched_tokens` has run (CUDA: free device
    # memory; CPU: available RAM), times `kv_memory_share` (the part of this device or host that is this
    # engine's: 1 / engines sharing it). On CPU it is also capped at `kv_cpu_max_bytes`. Never more than
    # every row at full context needs.
    kv_memory_fraction: float = 0.9
    kv_memory_share: float = 1.0
    kv_cpu_max_bytes: int = 2 * GIB
    device: str = "auto"  # auto (cuda when torch sees one), cpu, cuda or cuda:N
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # capped at max_num_seqs
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None: the model's context length
    dtype: str = "float32"  # float32, bfloat16, float16, or auto (see `auto_dtype`; resolved by the engine)
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "int8" (per-token-head scales)
    enable_prefix_caching: bool = True
    # CPU only: keep a oneDNN-prepacked copy of each projection weight (kernels/linear.py); ~1.6x
    # faster GEMMs at decode batch sizes for one more copy of the weights in memory.
    prepack_weights: bool = True
    seed: int = 0
    # Each tenant's guaranteed and maximum share of the KV blocks (shares.py); none: one shared pool.
    tenant_kv_shares: TenantShares = field(default_factory=TenantShares)
    # Host memory a preempted batch-class request's KV may be offloaded to instead of being
    # recomputed later (offload.py); 0 turns offload off.
    max_offload_bytes: int = GIB
    # Which free blocks a request's KV goes to (paging.py): lazy (the free queue's order) or
    # request-aware (long requests take contiguous runs held ahead); hashes and sharing are the same.
    kv_paging: PagingPolicy = field(default_factory=PagingPolicy)
    # Speculative decoding (spec/): the proposer, and k at most; the engine decides per step and row.
    speculation: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if not 0 < self.kv_memory_fraction <= 1 or not 0 < self.kv_memory_share <= 1:
            raise ValueError("kv_memory_fraction and kv_memory_share must be in (0, 1]")
        if self.max_offload_bytes < 0:
            raise ValueError(f"max_offload_bytes must be >= 0, got {self.max_offload_bytes}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if any(b < 1 for b in self.cuda_graph_batch_sizes):
            raise ValueError("cuda_graph_batch_sizes must be positive")
        if not isinstance(self.kv_paging, PagingPolicy):
            raise ValueError(f"kv_paging must be a PagingPolicy, got {type(self.kv_paging).__name__}")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'int8', got {self.kv_cache_dtype!r}")

    def resolved(self, device: torch.device) -> "EngineConfig":
        """This config with its device and an "auto" dtype made concrete for `device`."""
        dtype = auto_dtype(device) if self.dtype == "auto" else self.dtype
        return replace(self, device=str(device), dtype=dtype)

    @property
    def kv_dtype(self) -> torch.dtype:
        return torch.int8 if self.kv_cache_dtype == "int8" else parse_dtype(self.dtype)
