"""Fixtures of the data-plane worker tests: a tiny model on disk (the Ray cluster is in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.engine.tiny_model import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("workers-tiny-llama"), seed=0)
