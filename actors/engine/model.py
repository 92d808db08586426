"""Llama-family decoder (dense SwiGLU or Mixtral-style top-k MoE) over a paged KV cache.

The forward pass takes a flat, ragged batch: all new tokens of all scheduled sequences in one
[num_tokens] vector, with their positions. Each layer writes the new tokens' K/V into the paged
cache and attends through `kernels/`, so prefill chunks, decodes and prefix-cache hits are the same
code path. Logits are computed only for the rows in `logits_indices` (the last new token of each
sequence that is due a sample), which keeps the 49k-wide head off the prefill tokens.

Weights are loaded by HF name (see `load_weights`); Q/K/V and gate/up are fused into one matmul
each at load time, which matters on CPU where every op has a fixed cost.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from actors.engine.config import ModelConfig
from actors.engine.moe.layer import SparseMoE
from kernels import AttentionMetadata, Linear, paged_attention, rms_norm, write_kv

class KVCache(NamedTuple):
    """One layer's paged cache. int8 storage adds per-(token, head) float32 scales."""

    k: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, Hkv], int8 storage only
    v_scale: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the reference implementation does, cast back before the scale
        # (kernels.rms_norm: one native call on CPU instead of eight torch ops).
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.rope_type == "llama3":
        # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """rotate_half RoPE (HF layout) with precomputed cos/sin tables indexed by position.

    rotate_half(x) * sin == swap_halves(x) * sin_signed, where sin_signed is sin with its first half
    negated: the same products (a sign flip is exact), so the result equals HF's bit for bit, in
    three ops on the fused q|k rows instead of a dozen on q and k apart."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("cos", torch.empty(0), persistent=False)  # [max_pos, D]
        self.register_buffer("sin_signed", torch.empty(0), persistent=False)
        if self.cos.device.type != "meta":  # on meta, `reset_tables` runs once the model is real
            self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)computes the tables; needed after building the model on the meta device, since
        they are derived from the config, not loaded with the weights."""
        inv_freq = rope_inv_freq(self.cfg).to(self.cos.device)
        pos = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(pos, inv_freq)  # [max_pos, D/2]
        self.cos = torch.cat((freqs, freqs), dim=-1).cos()
        self.sin_signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin_signed rows for a batch, gathered once per forward and shared by every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin_signed[positions].to(dtype)[:, None, :]  # [T, 1, D]


def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, H, D] (any heads: q and k rows together) -> rotated, a new contiguous tensor."""
    cos, sin_signed = cos_sin
    t, h, d = x.shape
    swapped = x.reshape(t, h, 2, d // 2).flip(2).view(t, h, d)  # [x2, x1]
    return x * cos + swapped * sin_signed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), cos_sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, Hq, D], [T, Hkv, D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        c = kv_cache
        write_kv(k, v, c.k, c.v, meta.slot_mapping, c.k_scale, c.v_scale)
        o = paged_attention(q, c.k, c.v, meta, self.scale, c.k_scale, c.v_scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = SparseMoE(cfg) if cfg.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos_sin, kv_cache, meta):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # [S_out]
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Logits [S_out, V] of the rows `logits_indices`. `num_layers`: run only the first layers,
        then the final norm and head (a self-speculative draft: `spec/proposers.py`); the KV of the
        layers run is written as the full forward would write it."""
        x = self.embed_tokens(input_ids)  # [T, H]
        cos_sin = self.rope.lookup(positions, x.dtype)
        for layer, kv_cache in zip(self.layers[:num_layers], kv_caches):
            x = layer(x, cos_sin, kv_cache, meta)
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()  # [S_out, V]

    def pack_weights(self) -> int:
        """Prepacks every projection's weight for the CPU GEMM (see kernels/linear.py); returns how
        many were packed (0 off CPU or without oneDNN). Call once the dtype and weights are final:
        `load_weights` and any `.to()` drop the packed copies."""
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copies HF-named tensors in, fusing q/k/v, gate/up and per-expert weights. Accepts both
        the Mixtral checkpoint layout (block_sparse_moe.experts.j.w1/w2/w3) and transformers 5's
        fused one (mlp.experts.gate_up_proj/down_proj). Every parameter must be covered."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.unpack()  # the packed copies would be stale
        if self.cfg.tie_word_embeddings:
            # re-tie: moving the module between devices (meta -> cpu) can split shared parameters
            self.lm_head.weight = self.embed_tokens.weight
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, value: torch.Tensor, rows: slice | None = None) -> None:
            p = params[name]
            target = p.data if rows is None else p.data[rows]
            assert target.shape == value.shape, f"{name}: expected {tuple(target.shape)}, got {tuple(value.shape)}"
            target.copy_(value)
            loaded.add(name)

        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        qkv_rows = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
        expert_rows = {"w1": slice(0, inter), "w3": slice(inter, 2 * inter)}
        for name, value in tensors.items():
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            name = name.removeprefix("model.")
            if m := re.fullmatch(r"(layers\.\d+)\.self_attn\.([qkv]_proj)\.(weight|bias)", name):
                put(f"{m[1]}.self_attn.qkv_proj.{m[3]}", value, qkv_rows[m[2]])
            elif m := re.fullmatch(r"(layers\.\d+)\.mlp\.(gate|up)_proj\.weight", name):
                put(f"{m[1]}.mlp.gate_up_proj.weight", value, slice(0, inter) if m[2] == "gate" else slice(inter, 2 * inter))
            elif m := re.fullmatch(r"(layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight", name):
                e = int(m[2])
                if m[3] == "w2":
                    self._put_expert(params, f"{m[1]}.mlp.w2", e, value, None, loaded)
                else:
                    self._put_expert(params, f"{m[1]}.mlp.w13", e, value, expert_rows[m[3]], loaded)
            elif m := re.fullmatch(r"(layers\.\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight", name):
                put(f"{m[1]}.mlp.gate.weight", value)
            elif m := re.fullmatch(r"(layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name):
                put(f"{m[1]}.mlp.{'w13' if m[2] == 'gate_up_proj' else 'w2'}", value)
            elif name == "embed_tokens.weight" or name in params:
                put(name, value)
            elif name == "lm_head.weight":
                put("lm_head.weight", value)
            else:
                raise ValueError(f"unexpected weight {name!r}")
        missing = set(params) - loaded
        if cfg.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"weights missing for {sorted(missing)[:8]}")

    @staticmethod
    def _put_expert(params, name, expert, value, rows, loaded) -> None:  # type: ignore[no-untyped-def]
        target = params[name].data[expert]
        if rows is not None:
            target = target[rows]
        assert target.shape == value.shape, f"{name}[{expert}]: {tuple(target.shape)} vs {tuple(value.shape)}"
        target.copy_(value)
        loaded.add(name)
