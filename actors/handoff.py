"""The small agreements both ends of a KV handoff must share: tag, layout, block chain, block count.

Mental model: a prefill worker and a decode worker never exchange Python objects for the KV, only
codec shards. They agree, without talking, on
- the transfer tag: a stable 63-bit hash of the request id (shards carry it in their header and
  the transport's tag; the receiver finds its reservation by it),
- the KV layout (model, layers, heads, head_dim, block size) the codec checks on every shard,
- the request's chained block hashes (the engine's own `Request` computes them, salt and shared
  prefix included, so the pool, both engines and the router all name a block the same way),
- how many blocks travel: those holding the first `len(prompt) - 1` tokens, since the decode
  engine recomputes the last prompt token to sample the first output token.
"""

from __future__ import annotations

import hashlib

import torch

from actors.engine.block_hash import BlockHash
from actors.engine.engine import Engine
from actors.engine.request import Request
from actors.engine.sampling import SamplingState
from actors.messages import GenerationRequest
from transfer.codec import KVLayout
from transfer.units import MIB

TAG_BITS = 63


def transfer_tag(request_id: str) -> int:
    """Stable across processes (never Python's salted `hash`), non-negative, fits an int64."""
    digest = hashlib.sha256(b"kv:" + request_id.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - TAG_BITS)


def kv_layout(engine: Engine) -> KVLayout:
    m = engine.model_config
    return KVLayout(model=m.name, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                    head_dim=m.head_dim, block_size=engine.cfg.block_size)


def prompt_block_hashes(req: GenerationRequest, block_size: int) -> list[BlockHash]:
    """Hashes of the prompt's full blocks, exactly as an engine admitting `req` computes them."""
    # Building the engine's Request (cheap: no model work) keeps one definition of the chain,
    # including the shared-prefix rule that leaves the salt out of opted-in blocks.
    state = SamplingState(params=req.params, seed=req.seed or 0, prompt_token_ids=list(req.prompt_token_ids),
                          output_token_ids=[])
    shadow = Request(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), sampling=state,
                     block_size=block_size, extra_keys=tuple(req.cache_salt or ()),
                     num_shared_prefix_tokens=req.num_shared_prefix_tokens)
    return list(shadow.block_hashes)


def num_handoff_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Blocks that hold the KV of every prompt token but the last."""
    return -(-(num_prompt_tokens - 1) // block_size)


class HandoffTooLarge(ValueError):
    """One layer of a request's KV does not fit the transport's staging: no shard count can ship it."""


def num_handoff_shards(raw_bytes: int, num_layers: int, wanted: int, staging_bytes: int) -> int:
    """Layer groups to ship `raw_bytes` of KV in: the configured `wanted`, or more when a shard
    would take over a quarter of the staging (so several shards, and another request's, fit in
    flight at once; a long prompt's KV, ~180 MiB for SmolLM2 at 8k tokens in bf16, is far past
    the default 64 MiB). At most one layer per shard; a layer over the whole staging is refused.
    `raw_bytes` bounds the encoded size: compression only shrinks it (headers aside)."""
    per_layer = -(-raw_bytes // num_layers)
    if per_layer > staging_bytes:
        raise HandoffTooLarge(f"one layer of this request's KV is {per_layer / MIB:.1f} MiB, more than the "
                              f"{staging_bytes / MIB:.0f} MiB transfer staging (transfer.staging_mib)")
    needed = -(-raw_bytes // max(1, staging_bytes // 4))
    return max(1, min(num_layers, max(wanted, needed)))


def zero_stale_tail(kv: torch.Tensor, num_prompt_tokens: int, block_size: int) -> None:
    """Zeroes, in place, the slots of the last handed-off block past the prompt: they hold KV left
    by the block's earlier owner, which the receiver never reads but which would otherwise widen
    the int8/fp8 scales the codec computes over each block. kv: [L, 2, n, bs, Hkv, D], a copy."""
    n = kv.shape[2]
    valid = num_prompt_tokens - (n - 1) * block_size  # prompt tokens in the last block
    if 0 < valid < block_size:
        kv[:, :, n - 1, valid:] = 0


def num_reusable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks a prefill can take from a cache: at least one token is always computed."""
    return (num_prompt_tokens - 1) // block_size
