"""Write a tiny random Llama or Mixtral model as an HF folder, for tests and demos without downloads.

Mental model: the folder is what a real HF checkpoint looks like (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json), so every loader (ours, transformers) reads it unchanged
and tests can compare the two. Everything is a pure function of the arguments: weights come from a
seeded `torch.Generator`, the byte-level BPE tokenizer is trained on the fixed corpus below, and
JSON is written with sorted keys, so the same seed gives byte-identical files.

The weights are random but not degenerate: Linear weights have std 1/sqrt(fan_in) and embeddings
std 1, so q.k scores are O(1) and attention really depends on positions and token order (with
std 0.02 everywhere attention would be near-uniform and RoPE or KV-cache bugs would barely show
in the logits); norms are 1 + noise, so a missed norm weight changes the output.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from actors.engine.config import ModelConfig
from actors.engine.weights import expected_shapes

logger = logging.getLogger(__name__)

BOS_TOKEN, EOS_TOKEN, IM_START, IM_END = "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]  # ids 0, 1, 2, 3

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text for the tokenizer. Changing it changes every tiny model's token ids.
CORPUS = """\
The ferry leaves the harbor at seven in the morning and crosses the bay in forty minutes. On calm
days the passengers stand on the upper deck, drink coffee, and watch the gulls follow the wake.
When the wind turns north the crossing is rough, and the captain asks everyone to stay inside.

A language model reads a prompt one token at a time and predicts the next token. The server keeps
the keys and values of earlier tokens in a cache, split into blocks of sixteen tokens, so that a
long conversation does not have to be computed again for every new word. When the cache is full,
the oldest blocks that nobody is using are evicted first.

The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain is Madrid.
Paris is known for its museums, its bridges over the river Seine, and its small cafes where people
sit for hours. Many travelers arrive by train and walk from the station to the old city.

To bake simple bread, mix flour, water, salt and yeast, then knead the dough for ten minutes. Let
it rise in a warm place until it doubles in size. Shape the loaf, let it rest again, and bake it in
a hot oven until the crust is brown and the bottom sounds hollow when you tap it.

User: What is the weather like today? Assistant: It is sunny and warm, with a light breeze from
the west. Tomorrow there may be rain in the afternoon, so take an umbrella if you go out. Numbers
such as 1, 2, 3, 10, 42, 100 and 2024 appear in questions, answers, dates and prices.
"""


def train_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` trained on CORPUS (at most `vocab_size` tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must cover the 256 bytes and {len(SPECIAL_TOKENS)} special tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    return tokenizer


def write_tiny_model(
    out_dir: str | Path,
    *,
    moe: bool = False,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
) -> Path:
    """Writes the folder and returns its path. `vocab_size` >= the trained tokenizer's size."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    token_id = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    hf_config = _hf_config(
        moe=moe, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok, tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=token_id[BOS_TOKEN],
        # </s> ends plain text, <|im_end|> ends a chat turn: generation stops on either.
        eos_token_id=[token_id[EOS_TOKEN], token_id[IM_END]],
    )
    _write_json(out / "config.json", hf_config)
    save_file(random_weights(ModelConfig.from_hf_config(hf_config), seed), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer, max_position_embeddings))
    logger.info("wrote tiny %s model to %s (seed %d)", "mixtral" if moe else "llama", out, seed)
    return out


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random tensors for every name `expected_shapes(cfg)` lists, drawn in a fixed order."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():  # insertion order: deterministic
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            tensors[name] = 0.1 * noise
        elif name == "model.embed_tokens.weight":
            tensors[name] = noise
        else:  # Linear [out, in]: unit-variance outputs for unit-variance inputs
            tensors[name] = noise / math.sqrt(shape[1])
    return tensors


def _hf_config(*, moe: bool, **fields: Any) -> dict[str, Any]:
    hidden, heads = fields["hidden_size"], fields["num_heads"]
    cfg: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        "vocab_size": fields["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": fields["intermediate_size"],
        "num_hidden_layers": fields["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": fields["num_kv_heads"],
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": fields["max_position_embeddings"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": fields["tie_word_embeddings"],
        "bos_token_id": fields["bos_token_id"],
        "eos_token_id": fields["eos_token_id"],
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if moe:
        cfg.update(num_local_experts=fields["num_experts"], num_experts_per_tok=fields["num_experts_per_tok"],
                   router_aux_loss_coef=0.0, output_router_logits=False, sliding_window=None)
    else:
        cfg.update(mlp_bias=False, pretraining_tp=1)
    return cfg


def _tokenizer_config(tokenizer: Any, max_length: int) -> dict[str, Any]:
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
