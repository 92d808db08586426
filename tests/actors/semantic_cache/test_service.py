"""The async service in this process (no Ray): concurrent lookups share one forward of the real
MiniLM, a batch that runs collects the next one, and saves happen on the timer and on close."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from actors.semantic_cache import CachedResponse, CacheKey, SemanticCacheConfig
from actors.semantic_cache.batcher import LookupBatcher
from actors.semantic_cache.embedder import shared_minilm
from actors.semantic_cache.persist import MANIFEST
from actors.semantic_cache.service import SemanticCacheService, ServiceConfig
from actors.semantic_cache.worker import SemanticCacheWorker
from tests.actors.semantic_cache.test_embedding import KEY, PARAPHRASES, STORED, THRESHOLD

CFG = SemanticCacheConfig(threshold=THRESHOLD)


def answer(i: int) -> CachedResponse:
    return CachedResponse(f"answer {i}", (i,), "stop")


def service(folder: Path | None, **kw: object) -> SemanticCacheService:
    return SemanticCacheService.open(CFG, ServiceConfig(folder=folder, **kw), shared_minilm())  # type: ignore[arg-type]


def reloaded(folder: Path) -> SemanticCacheWorker:
    return SemanticCacheWorker(CFG, shared_minilm(), folder=folder)


def test_concurrent_lookups_share_one_forward(tmp_path: Path) -> None:
    async def run() -> None:
        svc = service(tmp_path, batch_window_s=0.05, save_interval_s=None)
        for i, text in enumerate(STORED):
            await svc.insert(KEY, text, answer(i))
        before = await svc.stats()
        results = await asyncio.gather(*(svc.lookup_many([(KEY, text)]) for text in PARAPHRASES))
        after = await svc.stats()
        assert [r.hit.response.text if r.hit else None for [r] in results] == [f"answer {i}" for i in range(5)]
        assert (after.num_embedded - before.num_embedded, after.num_embed_batches - before.num_embed_batches) == (5, 1)
        other = CacheKey(KEY.model, "tenant-b", KEY.params_key)
        [miss] = await svc.lookup_many([(other, PARAPHRASES[0])])
        assert miss.hit is None and miss.best_similarity is None  # tenant-b's partition is empty

    asyncio.run(run())


def test_a_running_batch_collects_the_next_and_errors_stay_in_their_batch() -> None:
    started, release = threading.Event(), threading.Event()
    batches: list[list[str]] = []

    def run(batch: list[str]) -> list[str]:
        batches.append(batch)
        if batch == ["a"]:
            started.set()
            release.wait(10)
        if "bad" in batch:
            raise ValueError("boom")
        return [q.upper() for q in batch]

    async def main() -> None:
        batcher: LookupBatcher[str, str] = LookupBatcher(run, window_s=0)
        first = asyncio.ensure_future(batcher.submit("a"))
        await asyncio.to_thread(started.wait, 10)
        rest = asyncio.ensure_future(batcher.submit_many(["b", "c"]))
        await asyncio.sleep(0.05)  # b and c queue behind the running forward
        release.set()
        assert (await first, await rest) == ("A", ["B", "C"])
        with pytest.raises(ValueError, match="boom"):
            await batcher.submit_many(["bad", "x"])
        assert await batcher.submit("d") == "D"

    asyncio.run(main())
    assert batches == [["a"], ["b", "c"], ["bad", "x"], ["d"]]


def test_timer_saves_what_changed_and_close_saves_the_rest(tmp_path: Path) -> None:
    async def run() -> None:
        svc = service(tmp_path, save_interval_s=0.1, save_every=1000)
        await svc.insert(KEY, STORED[0], answer(0))
        deadline = time.monotonic() + 20
        while not (tmp_path / MANIFEST).exists():  # no explicit save: the timer's
            assert time.monotonic() < deadline, "the timer never saved"
            await asyncio.sleep(0.05)
        assert not svc.worker.dirty
        await svc.close()
        await svc.insert(KEY, STORED[1], answer(1))  # after close: answered, saved only by the next save
        await asyncio.sleep(0.3)
        assert len(reloaded(tmp_path).store) == 1
        await svc.close()

    asyncio.run(run())
    again = reloaded(tmp_path)
    assert len(again.store) == 2
    assert again.lookup(KEY, PARAPHRASES[1]).hit.response == answer(1)  # type: ignore[union-attr]
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert [e["prompt"] for p in manifest["partitions"] for e in p["entries"]] == STORED[:2]
