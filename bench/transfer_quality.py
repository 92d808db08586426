"""The quality part of `bench/transfer.py`: what compressed KV costs SmolLM2's greedy tokens.

Mental model: prefill a prompt, ship its KV through the codec into fresh blocks, decode greedy
tokens from each copy. "forced" feeds every copy the reference's tokens, so each step is a
comparison of its own (argmax agreement, max logit difference, KL). "free" lets each copy follow its
own tokens: after its first different token a copy writes another text, so free agreement mostly
says where the first flip fell. In bfloat16 the logits themselves are bf16, so a few percent of
greedy steps are exact ties, and the bf16 forward magnifies any change to its input into logit
moves of that size; hence the `1-ulp` row (every KV value one step of its dtype off) and the
`float32 model` row to read the codecs against, and a `(ties)` column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bench.common import progress as log
from transfer.codec import KVLayout, decode, encode

BLOCK_SIZE = 16  # the quality run's KV blocks
MODES = ("forced", "free")
PROMPTS = [
    "The history of the printing press begins in", "Photosynthesis is the process by which plants",
    "Write a short story about a lighthouse keeper who", "The three laws of thermodynamics state that",
    "In Python, a list comprehension is a concise way to", "The capital of Australia is Canberra, which",
    "A good recipe for banana bread needs", "The main causes of the French Revolution were",
    "To train a neural network, you first need", "Once upon a time in a small village by the sea,",
    "The difference between a virus and a bacterium is", "Explain how a bicycle stays upright while moving.",
    "The stock market crashed in 1929 because", "My favourite way to spend a rainy Sunday is",
    "The theory of plate tectonics explains", "Here is a haiku about autumn leaves:",
    "The most important rule of cybersecurity is", "Jupiter is the largest planet in our solar system and",
    "A healthy breakfast should include", "The key idea behind public-key cryptography is",
]


@dataclass
class Agreement:
    """One variant's forced steps against the reference's, tallied."""

    steps: int = 0
    same: int = 0  # argmax equal
    same_or_tied: int = 0  # ... or one side's logits tie its own pick with the other's (bf16 logits do)
    max_logit_diff: float = 0.0
    kl_sum: float = 0.0  # KL(reference || variant) of the next-token distributions, nats

    def add(self, logits: torch.Tensor, ref: torch.Tensor) -> None:
        """logits, ref: [rows, vocab] float32, row i of one against row i of the other."""
        a, r = logits.argmax(-1, keepdim=True), ref.argmax(-1, keepdim=True)
        same = (a == r)[:, 0]
        tied = (ref.gather(1, a) == ref.gather(1, r)) | (logits.gather(1, a) == logits.gather(1, r))
        log_p, log_q = torch.log_softmax(ref.double(), -1), torch.log_softmax(logits.double(), -1)
        self.steps += len(logits)
        self.same += int(same.sum())
        self.same_or_tied += int((same | tied[:, 0]).sum())
        self.max_logit_diff = max(self.max_logit_diff, float((logits - ref).abs().max()))
        self.kl_sum += float((log_p.exp() * (log_p - log_q)).sum())


def one_ulp_off(kv: torch.Tensor, seed: int) -> torch.Tensor:
    """Every value moved one step of its dtype, up or down at random: the smallest change to KV there
    is, so what it does to the tokens is the floor under any lossy codec."""
    up = torch.rand(kv.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    return torch.nextafter(kv, torch.where(up, torch.inf, -torch.inf).to(kv.dtype))


class DecodeBatch:
    """Sequences (prompt, name), each in its own blocks of one engine, decoded a forward per step."""

    def __init__(self, dtype: str, ids: list[list[int]], names: list[str], num_tokens: int) -> None:
        from actors.engine.config import EngineConfig
        from actors.engine.engine import Engine
        from actors.engine.fetch import resolve_model

        self.ids = ids
        n_blocks = -(-(max(map(len, ids)) + num_tokens) // BLOCK_SIZE)
        self.seqs = [(p, name) for p in range(len(ids)) for name in names]
        self.blocks = {sv: list(range(i * n_blocks, (i + 1) * n_blocks)) for i, sv in enumerate(self.seqs)}
        self.engine = Engine.from_pretrained(
            resolve_model("smollm2"),
            EngineConfig(block_size=BLOCK_SIZE, num_blocks=n_blocks * len(self.seqs), dtype=dtype))

    def prefill(self, name: str) -> torch.Tensor:
        """Every prompt into `name`'s blocks -> the logits after it, [num_prompts, vocab]."""
        from actors.engine.model_runner import SeqChunk

        return self.engine.runner.execute(
            [SeqChunk(ids, 0, self.blocks[(p, name)], True) for p, ids in enumerate(self.ids)])

    def step(self, step: int, feed: dict[tuple[int, str], int]) -> dict[tuple[int, str], torch.Tensor]:
        """Each sequence's token `feed[seq]` at position len(prompt) + step -> its logits [vocab]."""
        from actors.engine.model_runner import SeqChunk

        logits = self.engine.runner.execute(
            [SeqChunk([feed[(p, v)]], len(self.ids[p]) + step, self.blocks[(p, v)], True) for p, v in self.seqs])
        return dict(zip(self.seqs, logits))


def quality(num_prompts: int, num_tokens: int, dtype: str, prompt_tokens: int = 0) -> list[dict[str, Any]]:
    """Prefill each prompt once; ship its KV into fresh blocks through each codec; decode
    `num_tokens` greedy tokens from every copy, forced (fed the reference's tokens: per-step
    agreement, logit error) and free (its own tokens). Rows beside the codecs: `none` (bit-exact KV
    in other blocks and batch rows: must be 1.0), `1-ulp` (`one_ulp_off`: the floor), and for a
    reduced-precision dtype `float32 model`: the float32 model on the same tokens against this
    dtype's reference. `prompt_tokens` > 0: prompts of that many tokens of real text (windows of
    this repository's docs) instead of the short `PROMPTS`."""
    from actors.engine.fetch import resolve_model
    from actors.engine.tokenizer import Tokenizer
    from bench.shadow import doc_tokens, windows

    tok = Tokenizer.load(resolve_model("smollm2"))
    if prompt_tokens > 0:
        ids = windows(doc_tokens(tok), prompt_tokens, num_prompts)
    else:
        ids = [tok.encode(p) for p in PROMPTS[:num_prompts]]
    prompts = range(len(ids))
    kinds = ["none", "1-ulp", "int8", "fp8"]
    main = DecodeBatch(dtype, ids, ["ref"] + [f"{k}/{m}" for k in kinds for m in MODES], num_tokens)
    batches = [main]
    with torch.inference_mode():
        first = main.prefill("ref")
        cfg, runner = main.engine.model_config, main.engine.runner
        layout = KVLayout(cfg.name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE)
        for p in prompts:  # the decode side: the prompt's KV into each copy's own blocks
            n = -(-len(ids[p]) // BLOCK_SIZE)
            kv = runner.read_blocks(main.blocks[(p, "ref")][:n])
            shipped = {"1-ulp": one_ulp_off(kv, seed=p)} | {
                c: decode(encode(kv, layout, compression=c, num_shards=4), layout) for c in ("none", "int8", "fp8")}
            for k in kinds:
                for mode in MODES:
                    runner.write_blocks(main.blocks[(p, f"{k}/{mode}")][:n], shipped[k])
        tokens = {(p, v): [int(first[p].argmax())] for p, v in main.seqs}
        if dtype != "float32":
            f32 = DecodeBatch("float32", ids, [f"float32 model/{m}" for m in MODES], num_tokens)
            f32.prefill("float32 model/forced")
            own_first = f32.prefill("float32 model/free")
            tokens |= {(p, "float32 model/forced"): tokens[(p, "ref")][:1] for p in prompts}
            tokens |= {(p, "float32 model/free"): [int(own_first[p].argmax())] for p in prompts}
            kinds.append("float32 model")
            batches.append(f32)
        forced = {k: Agreement() for k in kinds}
        for step in range(num_tokens):
            feed = {(p, v): tokens[(p, "ref") if v.endswith("/forced") else (p, v)][-1] for p, v in tokens}
            rows = {sv: row for b in batches for sv, row in b.step(step, feed).items()}
            ref = torch.stack([rows[(p, "ref")] for p in prompts])
            for k in kinds:
                forced[k].add(torch.stack([rows[(p, f"{k}/forced")] for p in prompts]), ref)
            for sv, row in rows.items():
                tokens[sv].append(int(row.argmax()))
            if step % 16 == 15:
                log(f"quality: {step + 1}/{num_tokens} tokens")
    out = []
    for k in kinds:
        free = [[a == b for a, b in zip(tokens[(p, f"{k}/free")][1:], tokens[(p, "ref")][1:])] for p in prompts]
        a = forced[k]
        out.append({"variant": k, "forced_agreement": a.same / a.steps,
                    "forced_agreement_ties": a.same_or_tied / a.steps,
                    "free_agreement": sum(map(sum, free)) / (len(ids) * num_tokens),
                    "prompts_identical": sum(map(all, free)), "max_logit_diff": a.max_logit_diff,
                    "mean_kl": a.kl_sum / a.steps})
    return out
