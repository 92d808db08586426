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
