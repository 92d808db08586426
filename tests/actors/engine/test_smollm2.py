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


def test_the_exported_hf_folder_serves_the_same_tokens(engine, smollm2_gguf, smollm2_transformers,
                                                       smollm2_transformers_tokenizer, tmp_path):
    """`ferry models export`'s folder (what vLLM loads as the peer) holds the GGUF's weights: ferry
    loading the folder gives the GGUF engine's greedy tokens and the same chat prompt ids."""
    from safetensors import safe_open

    from actors.engine.export import HF_FILES, write_hf

    folder = write_hf(smollm2_transformers, smollm2_transformers_tokenizer, tmp_path / "hf", source=smollm2_gguf,
                      dtype="float32")
    assert all((folder / name).is_file() for name in HF_FILES)
    assert "quantization_config" not in (folder / "config.json").read_text()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()  # tied head
    exported = Engine.from_pretrained(folder, EngineConfig(kv_cache_bytes=64 << 20))
    ids = engine.encode_chat(MESSAGES)
    assert exported.encode_chat(MESSAGES) == ids
    greedy = SamplingParams(max_tokens=32, temperature=0)
    [want] = engine.generate([ids], greedy)
    [got] = exported.generate([ids], greedy)
    assert list(got.token_ids) == list(want.token_ids) and got.text == want.text
