"""Owns the model and its paged KV cache, and turns a list of per-sequence chunks into one forward.

Each `SeqChunk` is "compute KV for these new tokens, which start at position `start_pos`, in these
blocks, and give me logits for the last one if asked". The runner puts single-token chunks
(decodes) first, as the attention kernels want, and hands the logits back in the caller's order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from actors.engine.config import ModelConfig
from actors.engine.model import CausalLM, KVCache
from kernels import AttentionMetadata, dequantize_int8, quantize_int8


@dataclass(frozen=True)
class SeqChunk:
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    needs_logits: bool
    # Logits for this many trailing tokens (a speculative verify: one row per proposed token and one
    # more), in position order; only with `needs_logits`.
    num_logits: int = 1


def attention_layout(chunks: list[SeqChunk]) -> list[tuple[int, int, int]]:
    """The forward's attention rows in order, as (chunk, its first token in the row, tokens): a
    chunk is one row, except a verify chunk (every token due logits, after cached context), whose
    tokens are decode rows of their own (the batched decode kernels, not one small ragged prefill
    per row). Single-token rows go first, each group in chunk order, so a chunk's tokens stay
    adjacent. Whoever lays out per-token data of a forward (MoE budgets) uses this too."""
    rows = []
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        if n > 1 and c.needs_logits and c.num_logits == n and c.start_pos > 0:
            rows += [(i, j, 1) for j in range(n)]
        else:
            rows.append((i, 0, n))
    return sorted(rows, key=lambda r: r[2] != 1)


class StepReplayer(Protocol):
    """A faster path for some steps; `DecodeGraphs` (actors/engine/cuda_graphs.py) replays
    captured CUDA graphs. `run(chunks)` is called only when `supports(chunks)`, and returns what
    `ModelRunner.execute` would: float32 logits [len(chunks), V] in the chunks' order."""

    def supports(self, chunks: list[SeqChunk]) -> bool: ...

    def run(self, chunks: list[SeqChunk]) -> torch.Tensor: ...


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    per_token_head = cfg.head_dim * elem + (4 if dtype == torch.int8 else 0)  # int8 carries a f32 scale
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * per_token_head


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On CPU it is calloc'd (numpy's zeros): the kernel maps zero pages on
    first write, so a pool costs RAM only as its blocks are used, while torch.zeros would write,
    and so commit, every page of a planned multi-GiB pool at start-up."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 *, pad_block: bool = False) -> None:
        """`kv_dtype` is the model's dtype, or torch.int8 for quantized KV storage (per-(token,
        head) scales; about half the bytes of bf16, so twice the blocks in the same memory).
        `pad_block`: one more block, `num_blocks`, outside the pool: padded rows of a captured
        decode step (actors/engine/cuda_graphs.py) write and read only there."""
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.model_dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_dtype
        self.pad_block: int | None = num_blocks if pad_block else None
        self.graphs: StepReplayer | None = None  # set by the engine when it captures graphs
        shape = (num_blocks + int(pad_block), block_size, cfg.num_kv_heads, cfg.head_dim)

        int8, dev = kv_dtype == torch.int8, self.device
        self.kv_caches: list[KVCache] = [
            KVCache(_zeros(shape, kv_dtype, dev), _zeros(shape, kv_dtype, dev),
                    _zeros(shape[:3], torch.float32, dev) if int8 else None,
                    _zeros(shape[:3], torch.float32, dev) if int8 else None)
            for _ in range(cfg.num_layers)
        ]

    def execute(self, chunks: list[SeqChunk], num_layers: int | None = None) -> torch.Tensor:
        """Runs one forward over all chunks; returns float32 logits [sum of num_logits of the chunks
        needing them, V] in the order of `chunks`. A decode-only step replays a captured graph when
        there is one. `num_layers`: only the first layers run (`CausalLM.forward`)."""
        if num_layers is None and self.graphs is not None and self.graphs.supports(chunks):
            return self.graphs.run(chunks)
        rows = attention_layout(chunks)
        num_decodes = sum(1 for _, _, m in rows if m == 1)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        first_token: dict[tuple[int, int], int] = {}  # (chunk, its token j) -> flat index, per row
        max_blocks = max(len(c.block_ids) for c in chunks)
        table = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
        for row, (i, j, m) in enumerate(rows):
            c = chunks[i]
            start, end = c.start_pos + j, c.start_pos + j + m
            assert len(c.block_ids) * bs >= end, "chunk's blocks do not cover its tokens"
            input_ids += c.token_ids[j : j + m]
            positions += range(start, end)
            slots += [c.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            first_token[(i, j)] = qsl[-1]
            qsl.append(qsl[-1] + m)
            seq_lens.append(end)
            table[row, : len(c.block_ids)] = torch.tensor(c.block_ids, dtype=torch.int32)
        logits_rows: list[int] = []  # in the chunks' order, each chunk's trailing num_logits tokens
        for i, c in enumerate(chunks):
            if c.needs_logits:
                n = len(c.token_ids)
                assert 1 <= c.num_logits <= n, (c.num_logits, n)
                for t in range(n - c.num_logits, n):
                    j = t if (i, t) in first_token else 0  # its own row, or inside the chunk's one row
                    logits_rows.append(first_token[(i, j)] + t - j)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decodes=num_decodes,
            max_seq_len=max(seq_lens),
            query_start_loc_list=tuple(qsl),
            seq_lens_list=tuple(seq_lens),
        )
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_caches,
            meta,
            torch.tensor(logits_rows, dtype=torch.int64, device=dev),
            num_layers,
        )
        return logits

    # ----------------------------------------------------------------- KV export / import (transfer)
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copies the KV of `block_ids` out of the cache: [num_layers, 2, n, block_size, Hkv, D]."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return torch.stack([torch.stack((self._read(c.k, c.k_scale, idx), self._read(c.v, c.v_scale, idx)))
                            for c in self.kv_caches])

    def _read(self, cache: torch.Tensor, scale: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
        # Quantized storage is handed out dequantized: the transfer codec has its own compression.
        if scale is None:
            return cache.index_select(0, idx)
        return dequantize_int8(cache.index_select(0, idx), scale.index_select(0, idx), self.model_dtype)

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor, layers: range | None = None) -> None:
        """Writes KV shaped like `read_blocks`' output (or its slice over `layers`) into `block_ids`."""
        layers = layers if layers is not None else range(len(self.kv_caches))
        assert kv.shape[0] == len(layers) and kv.shape[2] == len(block_ids), (tuple(kv.shape), len(block_ids))
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        kv = kv.to(self.device)  # KV decoded on the host (pool fetches, host-staged transports)
        for i, layer in enumerate(layers):
            c = self.kv_caches[layer]
            for j, (cache, scale) in enumerate(((c.k, c.k_scale), (c.v, c.v_scale))):
                if scale is None:
                    cache.index_copy_(0, idx, kv[i, j].to(cache.dtype))
                else:
                    q, s = quantize_int8(kv[i, j])
                    cache.index_copy_(0, idx, q)
                    scale.index_copy_(0, idx, s)
