"""Semantic cache on a paraphrase workload: hit rate, false-hit rate, P50 latency of hits vs misses.

Mental model: the OpenAI app (`build_api` over an in-process `EngineBackend`, SmolLM2 by default, or
a tiny random model with `--tiny`) is served by uvicorn with the semantic cache on. Each round
starts with an empty cache, sends every SEED prompt once (misses, inserted when they finish), then
the labelled queries: a PARAPHRASE of a seed should hit, a near-but-different UNRELATED prompt must
not. Hit rate = paraphrase hits / paraphrases; false-hit rate = unrelated hits / unrelated. Latency
is end to end through HTTP, so a hit's figure includes embedding and lookup.

    .venv/bin/python -m bench.semantic [--thresholds 0.8,0.9] [--max-tokens 12] [--tiny] [--json]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2 as httpx

from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.fetch import cached_model_path
from actors.engine.tiny_model import write_tiny_model
from actors.semantic_cache.embedder import shared_minilm
from actors.semantic_cache.service import SemanticCacheService, ServiceConfig
from bench.common import bench_parser, format_table, progress, run
from deploy.openai import ApiConfig, EngineBackend, build_api
from deploy.semantic import SemanticCacheSettings, SemanticGlue
from tests.server_thread import ServerThread

# (seed, paraphrase of it, a prompt on a nearby topic that needs a different answer)
TRIPLES: list[tuple[str, str, str]] = [
    ("What is the capital of France?", "Which city is the capital of France?", "What is the capital of Germany?"),
    ("How do I reverse a list in Python?", "In Python, how can I reverse a list?",
     "How do I sort a list in Python?"),
    ("Explain how photosynthesis works.", "Can you explain the process of photosynthesis?",
     "Explain how cellular respiration works."),
    ("What are the symptoms of the flu?", "What symptoms does influenza cause?",
     "What are the symptoms of diabetes?"),
    ("Translate 'good morning' into Spanish.", "How do you say 'good morning' in Spanish?",
     "Translate 'good night' into German."),
    ("Who wrote Romeo and Juliet?", "Who is the author of Romeo and Juliet?", "Who painted the Mona Lisa?"),
    ("How many legs does a spider have?", "What is the number of legs on a spider?",
     "How many legs does an insect have?"),
    ("What is the boiling point of water?", "At what temperature does water boil?",
     "What is the freezing point of water?"),
    ("Give me a recipe for pancakes.", "How do I make pancakes?", "Give me a recipe for lasagna."),
    ("What is the speed of light?", "How fast does light travel?", "What is the speed of sound?"),
    ("How do I change a flat tire?", "What are the steps to fix a flat tyre on a car?",
     "How do I change the oil in my car?"),
    ("Why is the sky blue?", "What makes the sky look blue?", "Why is the sunset red?"),
]


def _engine(tiny: bool) -> tuple[Engine, str]:
    if tiny:
        path = write_tiny_model(Path(tempfile.mkdtemp(prefix="sc-bench-")), seed=0)
        return Engine.from_pretrained(path, EngineConfig(num_blocks=256)), "tiny"
    return Engine.from_pretrained(cached_model_path("smollm2"), EngineConfig(num_blocks=256)), "smollm2"


def _ask(base_url: str, model: str, text: str, max_tokens: int) -> tuple[float, bool]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": max_tokens}
    started = time.perf_counter()
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300,
                   headers={"x-ferry-semantic-cache": "on"})
    elapsed_ms = (time.perf_counter() - started) * 1000
    r.raise_for_status()
    return elapsed_ms, r.headers.get("x-ferry-cache") == "semantic"


def run_round(backend: EngineBackend, threshold: float, max_tokens: int) -> dict[str, Any]:
    settings = SemanticCacheSettings(threshold=threshold)
    service = SemanticCacheService.open(settings.cache_config(), ServiceConfig(folder=None), shared_minilm())
    worker = service.worker
    glue = SemanticGlue(settings, service)
    cfg = ApiConfig(auth_required=False)
    hit_ms: list[float] = []
    miss_ms: list[float] = []
    labelled: dict[str, list[bool]] = {"paraphrase": [], "unrelated": []}
    with ServerThread(build_api(backend, cfg, semantic=glue)) as server:
        for seed, _, _ in TRIPLES:
            ms, hit = _ask(server.base_url, backend.model_name, seed, max_tokens)
            (hit_ms if hit else miss_ms).append(ms)
        deadline = time.monotonic() + 60
        while worker.stats().num_inserts < len(TRIPLES) and time.monotonic() < deadline:
            time.sleep(0.05)  # inserts run after the answer
        for _, paraphrase, unrelated in TRIPLES:
            for label, text in (("paraphrase", paraphrase), ("unrelated", unrelated)):
                ms, hit = _ask(server.base_url, backend.model_name, text, max_tokens)
                (hit_ms if hit else miss_ms).append(ms)
                labelled[label].append(hit)
    stats = worker.stats()
    return {"threshold": threshold, "hit_rate": sum(labelled["paraphrase"]) / len(TRIPLES),
            "false_hit_rate": sum(labelled["unrelated"]) / len(TRIPLES), "num_hits": len(hit_ms),
            "num_misses": len(miss_ms), "p50_hit_ms": statistics.median(hit_ms) if hit_ms else None,
            "p50_miss_ms": statistics.median(miss_ms) if miss_ms else None, "cache_size": stats.size,
            "similarity_histogram": stats.similarity_histogram}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    progress("loading the engine and the embedding model")
    engine, name = _engine(args.tiny)
    async_engine = AsyncEngine(engine)
    shared_minilm()
    try:
        backend = EngineBackend(async_engine, name)
        rounds = []
        for t in (float(x) for x in args.thresholds.split(",")):
            progress(f"threshold {t}: {len(TRIPLES)} seeds, {2 * len(TRIPLES)} labelled queries")
            rounds.append(run_round(backend, t, args.max_tokens))
    finally:
        async_engine.shutdown()
    return {"model": name, "max_tokens": args.max_tokens, "num_pairs": len(TRIPLES), "rounds": rounds}


def render(f: dict[str, Any]) -> str:
    rows = [[r["threshold"], f"{r['hit_rate']:.0%}", f"{r['false_hit_rate']:.0%}", r["num_hits"], r["num_misses"],
             r["p50_hit_ms"], r["p50_miss_ms"]] for r in f["rounds"]]
    return format_table(["threshold", "hit rate", "false hits", "hits", "misses", "P50 hit ms", "P50 miss ms"],
                        rows, title=f"semantic cache, {f['model']}, {f['num_pairs']} labelled triples, "
                                    f"max_tokens {f['max_tokens']}")


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--thresholds", default="0.8,0.9", help="comma-separated cosine thresholds")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--tiny", action="store_true", help="tiny random model instead of SmolLM2")
    logging.basicConfig(level=logging.WARNING)
    run(bench, parser.parse_args(argv), render)


if __name__ == "__main__":
    main()
