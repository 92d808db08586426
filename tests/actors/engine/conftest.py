"""Shared engine fixtures: tiny random models on disk and the real SmolLM2 GGUF when available."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from actors.engine.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-moe"), moe=True, seed=1)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real model: FERRY_TEST_GGUF, else the cache, else fetched (CI fetches it: it is part of
    what `make run` needs anyway)."""
    from actors.engine.errors import ModelFetchError
    from actors.engine.fetch import fetch_model

    if env := os.environ.get("FERRY_TEST_GGUF"):
        return Path(env)
    try:
        return fetch_model("smollm2")
    except ModelFetchError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf: Path):
    """transformers' own model from the same GGUF (it dequantizes the same tensors), in float32:
    loaded once (~15 s) for the tests that check ferry against it."""
    transformers = pytest.importorskip("transformers")
    import torch

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_transformers_tokenizer(smollm2_gguf: Path):
    """transformers' tokenizer for the same GGUF, the reference for ferry's (loaded once)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
