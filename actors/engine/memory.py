"""How big an engine's KV block pool is, and why: the plan made once at start-up.

Mental model (vLLM's `gpu_memory_utilization`, per engine): the weights are loaded first; then one
forward of the largest step the scheduler may build (`max_num_batched_tokens` tokens, with logits
for `max_num_seqs` rows) runs against a scratch cache while a `PeakMeter` watches; what the device
has free after that, less the step's peak, is what is left, and the pool takes
`kv_memory_fraction` of it, split by `kv_memory_share` (1 / the engines sharing this GPU or host;
see `_budget`).
Caps: never more than every row at full context needs, and on CPU at most `kv_cpu_max_bytes`
(RAM is shared with everything else on the host, and several workers plan at once). An explicit
`num_blocks` or `kv_cache_bytes` wins over the plan. A pool that cannot hold one request of
`max_model_len` tokens is an error at start-up, not a 429 later.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import torch

from actors.engine.config import EngineConfig
from actors.engine.device import MemoryInfo, PeakMeter, memory_info
from actors.engine.model import CausalLM
from actors.engine.model_runner import ModelRunner, SeqChunk, kv_bytes_per_block
from transfer.units import MIB

logger = logging.getLogger(__name__)


class InsufficientKVMemory(RuntimeError):
    """The memory left for the KV pool holds less than one request of `max_model_len` tokens."""


@dataclass(frozen=True)
class KVPlan:
    source: str  # "num_blocks" | "kv_cache_bytes" (explicit) | "planned"
    device: str
    num_blocks: int
    block_size: int
    bytes_per_block: int
    kv_bytes: int
    weights_bytes: int
    dtype: str = ""  # the engine's (weights and activations); the KV's when kv_cache_dtype is auto
    free_bytes: int | None = None  # planned only: free on the device after weights and the profile step
    activation_peak_bytes: int | None = None  # planned only: the profiled step's peak
    activation_measured: bool = True  # False: estimated (CPU, or no way to measure)
    fraction: float | None = None
    share: float | None = None
    capped_by: str | None = None  # "max_rows_context" | "kv_cpu_max_bytes" | None

    @property
    def max_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "max_tokens": self.max_tokens}

    def describe(self) -> str:
        line = (f"KV pool on {self.device} ({self.dtype}): {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.max_tokens} tokens, {self.kv_bytes / MIB:.0f} MiB ({self.source}")
        if self.source == "planned":
            line += (f": {self.fraction} x {self.share} of {(self.free_bytes or 0) / MIB:.0f} MiB free less a "
                     f"{(self.activation_peak_bytes or 0) / MIB:.0f} MiB step peak"
                     f"{'' if self.activation_measured else ' (estimated)'}")
            if self.capped_by:
                line += f", capped by {self.capped_by}"
        return line + f"); weights {self.weights_bytes / MIB:.0f} MiB"


def weights_bytes(model: CausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields tied ones once


def plan_kv_cache(model: CausalLM, cfg: EngineConfig, max_model_len: int) -> KVPlan:
    """The pool for `model` (already on its device, in its dtype) under `cfg`."""
    device = next(model.parameters()).device
    per_block = kv_bytes_per_block(model.cfg, cfg.block_size, cfg.kv_dtype)
    common = dict(device=str(device), block_size=cfg.block_size, bytes_per_block=per_block,
                  weights_bytes=weights_bytes(model), dtype=cfg.dtype)
    if cfg.num_blocks is not None:
        return KVPlan("num_blocks", num_blocks=cfg.num_blocks, kv_bytes=cfg.num_blocks * per_block, **common)
    if cfg.kv_cache_bytes is not None:
        n = max(1, cfg.kv_cache_bytes // per_block)
        return KVPlan("kv_cache_bytes", num_blocks=n, kv_bytes=n * per_block, **common)

    peak, measured = profile_step(model, cfg, max_model_len)
    mem = memory_info(device)
    budget = _budget(mem, peak, common["weights_bytes"], cfg, device)  # type: ignore[arg-type]
    capped_by = None
    rows_cap = cfg.max_num_seqs * math.ceil(max_model_len / cfg.block_size) * per_block
    if rows_cap < budget:
        budget, capped_by = rows_cap, "max_rows_context"
    if device.type == "cpu" and cfg.kv_cpu_max_bytes < budget:
        budget, capped_by = cfg.kv_cpu_max_bytes, "kv_cpu_max_bytes"
    num_blocks = budget // per_block
    _check_fits(num_blocks, cfg, max_model_len, mem, peak)
    return KVPlan("planned", num_blocks=num_blocks, kv_bytes=num_blocks * per_block, free_bytes=mem.free_bytes,
                  activation_peak_bytes=peak, activation_measured=measured, fraction=cfg.kv_memory_fraction,
                  share=cfg.kv_memory_share, capped_by=capped_by, **common)


def _budget(mem: MemoryInfo, peak: int, weights: int, cfg: EngineConfig, device: torch.device) -> int:
    """Bytes for the pool before the caps. One engine on its own GPU: the fraction of what is left
    after its weights and step peak. A GPU shared by engines (share < 1) is split by its total,
    so each engine gets the same pool whichever starts first: share x fraction of the GPU, less its
    own weights and peak, and never more than is free now. On CPU RAM is split by what is
    available (the pool's pages are only committed as blocks are written, so engines starting
    together see about the same figure)."""
    left = max(0, mem.free_bytes - peak) * cfg.kv_memory_fraction
    if device.type == "cuda":
        if cfg.kv_memory_share < 1:
            left = min(left, cfg.kv_memory_share * cfg.kv_memory_fraction * mem.total_bytes - weights - peak)
        return int(max(0, left))
    return int(left * cfg.kv_memory_share)


def _check_fits(num_blocks: int, cfg: EngineConfig, max_model_len: int, mem: MemoryInfo, peak: int) -> None:
    needed = math.ceil(max_model_len / cfg.block_size)
    if num_blocks < needed:
        raise InsufficientKVMemory(
            f"the KV pool would hold {num_blocks} blocks ({num_blocks * cfg.block_size} tokens), fewer than one "
            f"request of max_model_len={max_model_len} tokens needs ({needed} blocks): {mem.free_bytes / MIB:.0f} "
            f"MiB free ({mem.source}), a {peak / MIB:.0f} MiB step peak, kv_memory_fraction="
            f"{cfg.kv_memory_fraction}, kv_memory_share={cfg.kv_memory_share}. Lower max_model_len, raise "
            f"the fraction, or set kv_cache_bytes (engine.kv_cache_mib) explicitly")


def profile_step(model: CausalLM, cfg: EngineConfig, max_model_len: int) -> tuple[int, bool]:
    """Runs the largest step this engine can schedule against a scratch KV cache and returns (peak
    bytes it needed beyond the weights and the scratch cache, measured?). The step is prompt chunks
    plus single-token rows (`profile_chunks`), so both attention paths run and `max_num_seqs` rows
    get logits.

    On CPU the peak is estimated instead: such a forward costs 5-25 s of start-up on two cores
    (bf16 without AVX-512), while the pool there is bounded by `kv_cpu_max_bytes` long before a
    step's few tens of MiB matter (SmolLM2 at 512 tokens / 32 rows: 34 MiB estimated, 33 measured)."""
    device = next(model.parameters()).device
    tokens = cfg.max_num_batched_tokens
    rows = max(1, min(cfg.max_num_seqs, tokens))
    if device.type != "cuda":
        return estimate_step_bytes(model, cfg, tokens, rows), False
    chunks, num_blocks = profile_chunks(tokens, rows, max_model_len, cfg.block_size)
    scratch = ModelRunner(model, num_blocks, cfg.block_size, cfg.kv_dtype)
    meter = PeakMeter(device)
    with meter.measure():
        scratch.execute(chunks)
    del scratch
    assert meter.peak_bytes is not None
    return meter.peak_bytes, True


def profile_chunks(tokens: int, rows: int, max_model_len: int, block_size: int) -> tuple[list[SeqChunk], int]:
    """The profiled step: `rows - 1` single-token rows and the rest of the `tokens` budget as prompt
    chunks of at most `max_model_len` tokens each (positions past the model's context would index
    past its RoPE table). -> (chunks, scratch blocks they use, each chunk its own)."""
    chunks, used = [], 0
    left = tokens - (rows - 1)
    while left > 0:
        n = min(left, max_model_len)
        k = math.ceil(n / block_size)
        chunks.append(SeqChunk([0] * n, 0, list(range(used, used + k)), True))
        used, left = used + k, left - n
    chunks += [SeqChunk([0], 0, [used + i], True) for i in range(rows - 1)]
    return chunks, used + rows - 1


def estimate_step_bytes(model: CausalLM, cfg: EngineConfig, tokens: int, rows: int) -> int:
    """A generous bound on one step's transient tensors where they are not measured: a few
    copies of the widest per-token activations, the attention scores of the prompt chunk, and the
    float32 logits of every row (twice: the head's output and its float copy)."""
    m = model.cfg
    elem = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
    widest = max(m.hidden_size, 2 * m.intermediate_size, (m.num_heads + 2 * m.num_kv_heads) * m.head_dim)
    activations = 4 * tokens * widest * elem
    scores = m.num_heads * tokens * tokens * 4
    logits = 2 * rows * m.vocab_size * 4
    return activations + scores + logits
