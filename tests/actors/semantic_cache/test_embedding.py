"""Real all-MiniLM-L6-v2 embeddings through the worker: fixed paraphrases hit, fixed unrelated
prompts miss, and a tenant never sees another tenant's entry. The model loads once per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.semantic_cache import CachedResponse, CacheKey, SemanticCacheConfig
from actors.semantic_cache.embedder import MiniLMEmbedder, shared_minilm
from actors.semantic_cache.worker import SemanticCacheWorker

STORED = [
    "What is the capital of France?",
    "How do I reverse a list in Python?",
    "Explain how photosynthesis works.",
    "What are the symptoms of the flu?",
    "Translate 'good morning' into Spanish.",
]
PARAPHRASES = [  # PARAPHRASES[i] means STORED[i]
    "Which city is the capital of France?",
    "In Python, how can I reverse a list?",
    "Can you explain the process of photosynthesis?",
    "What symptoms does influenza cause?",
    "How do you say 'good morning' in Spanish?",
]
UNRELATED = [
    "What is the population of Japan?",
    "How do I sort a dictionary by value in Python?",
    "Write a poem about the ocean.",
    "What is the best way to learn the guitar?",
    "Translate 'good night' into German.",
]
KEY = CacheKey("smollm2", "tenant-a", "chat|temperature=0")
THRESHOLD = 0.8


@pytest.fixture(scope="module")
def embedder() -> Iterator[MiniLMEmbedder]:
    yield shared_minilm()


@pytest.fixture
def worker(embedder: MiniLMEmbedder, tmp_path: Path) -> SemanticCacheWorker:
    w = SemanticCacheWorker(SemanticCacheConfig(threshold=THRESHOLD), embedder, folder=tmp_path)
    for i, text in enumerate(STORED):
        w.insert(KEY, text, CachedResponse(f"answer {i}", (i,), "stop"))
    return w


def test_paraphrases_hit_their_own_entry(worker: SemanticCacheWorker) -> None:
    results = worker.lookup_many([(KEY, text) for text in PARAPHRASES])  # one batched forward
    assert [r.hit.response.text if r.hit else None for r in results] == [f"answer {i}" for i in range(5)]
    assert all(r.hit is not None and THRESHOLD <= r.hit.similarity <= 1.0 for r in results)


def test_unrelated_prompts_miss(worker: SemanticCacheWorker) -> None:
    results = worker.lookup_many([(KEY, text) for text in UNRELATED])
    assert [r.hit for r in results] == [None] * 5
    assert all(r.best_similarity is not None and r.best_similarity < THRESHOLD for r in results)


def test_tenants_are_isolated(worker: SemanticCacheWorker) -> None:
    other = CacheKey(KEY.model, "tenant-b", KEY.params_key)
    assert worker.lookup(other, STORED[0]).hit is None  # the very same prompt
    assert worker.lookup(KEY, STORED[0]).hit is not None
    stats = worker.stats()
    assert (stats.num_lookups, stats.num_hits, stats.size) == (2, 1, 5)


def test_restart_keeps_entries(worker: SemanticCacheWorker, embedder: MiniLMEmbedder, tmp_path: Path) -> None:
    worker.save()
    again = SemanticCacheWorker(worker.cfg, embedder, folder=tmp_path)
    assert len(again.store) == 5
    hit = again.lookup(KEY, PARAPHRASES[2]).hit
    assert hit is not None and hit.response.text == "answer 2" and hit.prompt == STORED[2]
