"""The real model: SmolLM2-135M-Instruct from its GGUF, checked against transformers loading the
same file (it dequantizes the same tensors)."""

from __future__ import annotations

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def engine(smollm2_gguf) -> Engine:
    return Engine.from_pretrained(smollm2_gguf, EngineConfig(kv_cache_bytes=128 << 20))


def test_greedy_chat_matches_transformers(engine, smollm2_transformers, smollm2_transformers_tokenizer):
    ids = engine.encode_chat(MESSAGES)
    [out] = engine.generate([ids], SamplingParams(max_tokens=32, temperature=0))
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"

    want = smollm2_transformers.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    assert list(out.token_ids) == want
    tok = smollm2_transformers_tokenizer
    assert ids == list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"])


def test_streamed_text_is_utf8_clean_and_complete(engine):
    ids = engine.encode_chat([{"role": "user", "content": "Write the word 'café' and a smiley emoji."}])
    engine.add_request("u", ids, SamplingParams(max_tokens=40, temperature=0))
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            final = out
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == final.text == engine.tokenizer.decode(list(final.token_ids))
