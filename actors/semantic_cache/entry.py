"""The values the store keeps: partition keys, cached responses and their bookkeeping.

Mental model: a `CacheKey` names one partition (model, tenant, sampling parameters); nothing ever
compares vectors across partitions, which is how tenants and parameter sets stay isolated. A
`CachedResponse` is what a hit replays: the finished text and tokens, never logprobs. An `Entry`
adds the decaying score; `score_at(now)` is the only place the decay formula lives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NewType

EntryId = NewType("EntryId", int)  # also the entry's hnswlib label within its partition


@dataclass(frozen=True, order=True)
class CacheKey:
    model: str
    tenant: str
    params_key: str  # a canonical string of every sampling-relevant parameter (and the endpoint)

    def file_stem(self) -> str:
        import hashlib

        return hashlib.sha256(repr((self.model, self.tenant, self.params_key)).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class CachedResponse:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: int | str | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "token_ids": list(self.token_ids)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "CachedResponse":
        return CachedResponse(d["text"], tuple(d["token_ids"]), d["finish_reason"], d.get("stop_reason"))


@dataclass
class Entry:
    entry_id: EntryId
    prompt: str  # the text that was embedded; kept for inspection and re-embedding
    response: CachedResponse
    score: float  # at `refreshed_at`
    refreshed_at: float  # clock seconds (wall time by default, so it survives restarts)
    pinned: bool = False
    num_hits: int = 0

    def score_at(self, now: float, half_life_s: float) -> float:
        if self.pinned:
            return float("inf")
        age_s = max(0.0, now - self.refreshed_at)
        return self.score * 0.5 ** (age_s / half_life_s)

    def to_json(self) -> dict[str, Any]:
        return {"entry_id": int(self.entry_id), "prompt": self.prompt, "response": self.response.to_json(),
                "score": self.score, "refreshed_at": self.refreshed_at, "pinned": self.pinned,
                "num_hits": self.num_hits}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Entry":
        return Entry(EntryId(d["entry_id"]), d["prompt"], CachedResponse.from_json(d["response"]), d["score"],
                     d["refreshed_at"], d["pinned"], d["num_hits"])
