"""The simulated GPU: how long one engine step takes, and how much KV fits.

Mental model: a step costs a fixed overhead plus the larger of its compute time and its memory
time (a roofline):

    compute = (2 * params * (prefill_tokens + decode_rows) + attn_flops_per_pair * pairs) / (peak * mfu)
    memory  = (weight_bytes + kv_bytes_per_token * context_tokens) / (hbm_bw * bw_efficiency)
    step    = overhead + max(compute, memory)

where `pairs` counts query-key pairs (prefill attention plus one pair per decode row and context
token). Defaults, with their sources and our assumptions:
- Model: Llama-3.1-8B (Meta's config.json on Hugging Face): 8.03e9 parameters, 32 layers, hidden
  4096, 8 KV heads of dim 128 (GQA), bf16. Hence 16.06 GB of weights, 131,072 bytes of KV per
  token (2 x 32 x 8 x 128 x 2 B) and 4 x 4096 x 32 = 524,288 attention FLOPs per query-key pair.
- GPU: NVIDIA H200 SXM datasheet: 989 TFLOPS dense BF16 (1,979 "with sparsity"), 4.8 TB/s HBM3e,
  141 GB. Assumed: 45% of peak in prefill GEMMs (model FLOPs utilisation), 80% of HBM bandwidth
  reached, 1 ms per-step overhead (scheduling, sampling, launches with CUDA graphs), 90% of memory
  given to the engine (vLLM's default gpu_memory_utilization) with 4 GB of activations reserved.
  This gives ~36 us per prefill token (~28k tokens/s) and a ~5.2 ms decode step at batch 1,
  in line with published vLLM/SGLang figures for 8B models on H100/H200 (same compute as H100,
  1.4x its bandwidth).
- Network: one 400 Gb/s NIC per GPU (ConnectX-7, as in DGX H200) at 50% efficiency = 25 GB/s for
  KV transfer between prefill and decode and for fetches from the prefix-cache pool, plus 1 ms
  per transfer.
`ProfileCost` replaces the roofline by a step-time table measured from this project's engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from cluster.cost_model import features


class StepCost(Protocol):
    """Seconds of one engine step with this work (see `cluster.descriptors.StepSample`)."""

    def step_s(self, prefill_tokens: int, prefill_pairs: float, decode_rows: int, context_tokens: int) -> float: ...


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str = "Llama-3.1-8B"
    num_params: float = 8.03e9
    num_layers: int = 32
    hidden_size: int = 4096
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attn_flops_per_pair(self) -> float:
        return 4.0 * self.hidden_size * self.num_layers


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str = "H200-SXM"
    peak_flops: float = 989e12
    hbm_bytes_per_s: float = 4.8e12
    hbm_bytes: float = 141e9
    mfu: float = 0.45
    bw_efficiency: float = 0.8
    step_overhead_s: float = 1e-3
    mem_utilization: float = 0.9
    activation_reserve_bytes: float = 4e9


@dataclass(frozen=True, slots=True)
class NetworkSpec:
    link_bytes_per_s: float = 25e9
    transfer_latency_s: float = 1e-3
    pool_bytes_per_s: float = 25e9


class RooflineCost:
    """The default step-time physics (module docstring)."""

    def __init__(self, model: ModelSpec = ModelSpec(), gpu: GpuSpec = GpuSpec()) -> None:
        self.model, self.gpu = model, gpu
        self._flops_per_token = 2.0 * model.num_params
        self._pair_flops = model.attn_flops_per_pair
        self._compute_rate = gpu.peak_flops * gpu.mfu
        self._mem_rate = gpu.hbm_bytes_per_s * gpu.bw_efficiency
        self._weights = model.weight_bytes
        self._kv = model.kv_bytes_per_token

    def step_s(self, prefill_tokens: int, prefill_pairs: float, decode_rows: int, context_tokens: int) -> float:
        compute = (self._flops_per_token * (prefill_tokens + decode_rows)
                   + self._pair_flops * (prefill_pairs + context_tokens)) / self._compute_rate
        memory = (self._weights + self._kv * context_tokens) / self._mem_rate
        return self.gpu.step_overhead_s + (compute if compute > memory else memory)

    def kv_capacity_tokens(self) -> int:
        g = self.gpu
        free = g.hbm_bytes * g.mem_utilization - self.model.weight_bytes - g.activation_reserve_bytes
        return int(free // self.model.kv_bytes_per_token)


class ProfileCost:
    """Step times fitted (least squares on `cluster.cost_model.features`) to a measured profile:
    a JSON list of {"prefill_tokens", "decode_rows", "context_tokens", "step_s"} (optionally
    "prefill_pairs"), times `scale` (e.g. to map a CPU engine onto a faster device)."""

    def __init__(self, path: str | Path, scale: float = 1.0) -> None:
        rows = json.loads(Path(path).read_text())
        entries = rows["entries"] if isinstance(rows, dict) else rows
        if len(entries) < 5:
            raise ValueError(f"{path}: a profile needs at least 5 entries, got {len(entries)}")
        x = np.array([features(e["prefill_tokens"], e.get("prefill_pairs", e["prefill_tokens"] ** 2 / 2.0),
                               e["decode_rows"], e["context_tokens"]) for e in entries])
        y = np.array([float(e["step_s"]) for e in entries]) * scale
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        self.coef = tuple(float(c) for c in coef)
        self.min_step_s = float(y.min()) * 0.5
        self.source = str(path)

    def step_s(self, prefill_tokens: int, prefill_pairs: float, decode_rows: int, context_tokens: int) -> float:
        x = features(prefill_tokens, prefill_pairs, decode_rows, context_tokens)
        return max(self.min_step_s, sum(c * v for c, v in zip(self.coef, x)))
