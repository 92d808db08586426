"""Prompt text with real shared prefixes: one deterministic block of words per Mooncake hash id.

Mental model: a prompt is the concatenation of its blocks, block i being a pure function of
(hash_ids[i], salt), so two requests whose hash ids agree on a leading run have byte-identical
text over that run, and therefore identical token prefixes in any BPE tokenizer whose
pre-tokenizer splits before a space (GPT-2 style, as SmolLM2 and llama.cpp's models use). Words are
short common English words that such tokenizers encode as one token each (" the", " cat"), so
words approximate tokens and the server's own `usage.prompt_tokens` reports the exact count.
Requests without hash ids (Azure) get a block seeded by their index: no accidental sharing.
"""

from __future__ import annotations

import hashlib
import random

from bench.loadgen.workload import BenchRequest

# Frequent lowercase words: one token with a leading space in GPT-2-style vocabularies.
WORDS: tuple[str, ...] = tuple("""
the of and to in is was for on that with as by at from his her it an are were be this which have
or had not but they one you all their has more we can been there when who also would its other out
into time only new after over first most some year two these many then them such about so up made
may between any world city where both three part well through school state life day during use
family great film under high people during house game music way four book law water war long end
south north east west land name work left right book team song area early last back even war line
""".split())
_UNIQUE_BASE = 1 << 40  # salt space for per-request blocks, far from Mooncake's small hash ids


def block_words(hash_id: int, num_words: int, salt: int = 0) -> list[str]:
    """The words of one block: a pure function of (hash_id, salt, num_words)."""
    digest = hashlib.blake2b(f"{salt}:{hash_id}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    return [rng.choice(WORDS) for _ in range(num_words)]


def prompt_words(req: BenchRequest, index: int, salt: int = 0) -> list[str]:
    """`req.prompt_len` words: its hash-id blocks in order, then (if short) a per-request tail."""
    words: list[str] = []
    for h in req.hash_ids:
        if len(words) >= req.prompt_len:
            break
        words.extend(block_words(h, req.block_tokens, salt))
    if len(words) < req.prompt_len:
        # Unique per request, so requests without hash ids never share a prefix by chance.
        words.extend(block_words(_UNIQUE_BASE + index, req.prompt_len - len(words), salt))
    return words[: req.prompt_len]


def prompt_text(req: BenchRequest, index: int, salt: int = 0) -> str:
    """Every word carries its leading space, so block boundaries are token boundaries too."""
    return "".join(" " + w for w in prompt_words(req, index, salt))
