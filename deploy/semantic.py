"""The semantic cache as the HTTP layer sees it: who opts in, lookup before admission, insert after.

Mental model: the app asks `SemanticGlue.consult` before it hands a request to the backend. A request
takes part only when its tenant is listed in the settings or it sends `x-ferry-semantic-cache: on`
(`off` opts a listed tenant's request out), its sampling is greedy (unless `allow_sampling`), and it
asks for no logprobs (a cached answer has none to give). Its partition key is (served model,
tenant, endpoint + every sampling parameter), so nothing crosses tenants, models or parameters. A hit
becomes a one-output backend stream (the renderer serves it streamed or not, unchanged) and the
response carries `x-ferry-cache: semantic` and `x-ferry-cache-similarity`; the engine never sees it.
A miss wraps the backend stream so the finished answer is inserted, off the request's path. The
cache itself is any `SemanticCache` (actors/semantic_cache/service.py): in-process without Ray
(`from_settings`), the store actor on Ray (deploy/apps.py); either batches concurrent lookups into
one embedding forward. Any cache failure is logged and served as a miss: the cache may not break
serving. `close` (at the app's shutdown) waits for inserts in flight, then saves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from actors.engine.output import RequestOutput
from actors.engine.sampling import SamplingParams
from actors.semantic_cache import CachedResponse, CacheKey, SemanticCacheConfig
from actors.semantic_cache.service import ServiceConfig

if TYPE_CHECKING:
    from fastapi import Request, Response
    from actors.semantic_cache.service import SemanticCache
    from actors.semantic_cache.stats import SemanticCacheStats
    from actors.semantic_cache.worker import Lookup

logger = logging.getLogger(__name__)

OPT_IN_HEADER = "x-ferry-semantic-cache"
CACHE_HEADER = "x-ferry-cache"
SIMILARITY_HEADER = "x-ferry-cache-similarity"
Stream = AsyncGenerator[RequestOutput, None]


class SemanticCacheSettings(BaseModel):
    """The `semantic_cache` section of the API config (YAML/HTTP boundary: unknown keys refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: list[str] = Field(default_factory=list, description="Tenants whose requests use the cache "
                                                                 "unless they send the header set to off.")
    threshold: float = Field(0.9, ge=0.0, le=1.0, description="Cosine similarity a hit needs, in [0, 1].")
    half_life_s: float = Field(3600.0, gt=0, description="An unused entry's score halves this often.")
    score_floor: float = Field(0.05, ge=0.0, lt=1.0, description="Entries decayed below this are deleted.")
    max_entries: int = Field(10_000, ge=1, description="Hard bound over all tenants, pinned included.")
    allow_sampling: bool = Field(False, description="Also cache requests with temperature > 0.")
    folder: str | None = Field(None, description="Where the index is saved; default $FERRY_HOME/semantic_cache.")
    save_interval_s: float | None = Field(60.0, gt=0, description="Save this often while anything changed "
                                                                   "(null: only every 64 inserts and at shutdown).")
    batch_window_ms: float = Field(2.0, ge=0, description="How long a lookup waits for others to batch with.")
    timeout_s: float = Field(5.0, gt=0, description="Deadline of each call to the cache actor; late is a miss.")

    def cache_config(self) -> SemanticCacheConfig:
        return SemanticCacheConfig(threshold=self.threshold, half_life_s=self.half_life_s,
                                   score_floor=self.score_floor, max_entries=self.max_entries)

    def service_config(self) -> ServiceConfig:
        from actors.semantic_cache.persist import default_cache_dir

        folder = Path(self.folder).expanduser() if self.folder else default_cache_dir()
        return ServiceConfig(folder=folder, save_interval_s=self.save_interval_s,
                             batch_window_s=self.batch_window_ms / 1000)


def params_key(endpoint: str, params: SamplingParams) -> str:
    # Every field, so any difference (max_tokens, stop, seed, penalties) is a different partition.
    fields = ",".join(f"{f.name}={getattr(params, f.name)!r}" for f in dataclasses.fields(params))
    return f"{endpoint}|{fields}"


@dataclass(frozen=True)
class Consulted:
    """What one request learned from the cache; `stream` is set on a hit."""

    key: CacheKey
    text: str
    lookup: Lookup | None
    stream: Stream | None = None


class SemanticGlue:
    def __init__(self, settings: SemanticCacheSettings, cache: SemanticCache) -> None:
        self.settings = settings
        self.cache = cache
        self._inserts: set[asyncio.Task[Any]] = set()

    @classmethod
    def from_settings(cls, settings: SemanticCacheSettings) -> "SemanticGlue":
        """The cache in this process (no Ray): the process's one MiniLM, reloading the folder."""
        from actors.semantic_cache.embedder import shared_minilm
        from actors.semantic_cache.service import SemanticCacheService

        return cls(settings, SemanticCacheService.open(settings.cache_config(), settings.service_config(),
                                                       shared_minilm()))

    def wants(self, request: Request, params: SamplingParams, tenant: str) -> bool:
        choice = request.headers.get(OPT_IN_HEADER, "").strip().lower()
        opted = choice == "on" or (tenant in self.settings.tenants and choice != "off")
        return opted and (params.is_greedy or self.settings.allow_sampling) and params.logprobs is None

    async def consult(self, request: Request, *, endpoint: str, model: str, text: str | None,
                      params: SamplingParams, num_prompt_tokens: int) -> Consulted | None:
        """None when the request does not take part; else the lookup's outcome (a miss on failure)."""
        tenant = request.state.tenant
        if text is None or not self.wants(request, params, tenant):
            return None
        key = CacheKey(model, tenant, params_key(endpoint, params))
        try:
            [lookup] = await self.cache.lookup_many([(key, text)])
        except Exception:
            logger.exception("semantic cache lookup failed; serving as a miss")
            return Consulted(key, text, None)
        if lookup.hit is None:
            return Consulted(key, text, lookup)
        return Consulted(key, text, lookup, _replay(lookup.hit.response, num_prompt_tokens))

    async def record(self, consulted: Consulted, stream: Stream) -> Stream:
        """Passes `stream` through and inserts its answer once it finishes normally."""
        try:
            async for out in stream:
                if out.finished and out.finish_reason in ("stop", "length"):
                    response = CachedResponse(out.text, out.token_ids, out.finish_reason, out.stop_reason)
                    self._insert_later(consulted, response)
                yield out
        finally:
            await stream.aclose()

    def _insert_later(self, consulted: Consulted, response: CachedResponse) -> None:
        vector = consulted.lookup.vector if consulted.lookup is not None else None

        async def insert() -> None:
            try:
                await self.cache.insert(consulted.key, consulted.text, response, vector)
            except Exception:
                logger.exception("semantic cache insert failed")

        task = asyncio.ensure_future(insert())
        self._inserts.add(task)  # the loop keeps weak references only
        task.add_done_callback(self._inserts.discard)

    async def drain(self) -> None:
        """Waits for inserts in flight (tests, shutdown)."""
        while self._inserts:
            await asyncio.gather(*list(self._inserts), return_exceptions=True)

    async def stats(self) -> SemanticCacheStats:
        return await self.cache.stats()

    async def close(self) -> None:
        """At shutdown: lets the inserts in flight land, then saves (logged, never raised)."""
        await self.drain()
        try:
            await self.cache.close()
        except Exception:
            logger.exception("semantic cache not saved at shutdown")

    @staticmethod
    def mark(response: Response, consulted: Consulted | None) -> Response:
        if consulted is None:
            return response
        hit = consulted.lookup.hit if consulted.lookup is not None else None
        response.headers[CACHE_HEADER] = "semantic" if hit is not None else "miss"
        if hit is not None:
            response.headers[SIMILARITY_HEADER] = f"{hit.similarity:.4f}"
        return response


async def _replay(cached: CachedResponse, num_prompt_tokens: int) -> Stream:
    # The whole answer as one finished delta: renderers make one chunk or one response of it.
    yield RequestOutput(request_id="", new_token_ids=cached.token_ids, new_text=cached.text, text=cached.text,
                        token_ids=cached.token_ids, finished=True, finish_reason=cached.finish_reason,
                        stop_reason=cached.stop_reason, num_prompt_tokens=num_prompt_tokens)


def semantic_text(body: Any) -> str | None:
    """The text a request is embedded by: a completion's prompt string, a chat's messages as
    `role: content` lines; None (no caching) for token-id prompts."""
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt or None
    messages = getattr(body, "messages", None)
    if not messages:
        return None
    lines = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        lines.append(f"{m.role}: {content}")
    return "\n".join(lines)
