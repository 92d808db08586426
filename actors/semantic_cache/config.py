"""`SemanticCacheConfig`: the semantic cache's own settings, checked once on construction.

Mental model: four knobs decide what the cache returns and keeps. `threshold` is the cosine
similarity a stored prompt must reach to answer a new one (a hit); every entry carries a score that
halves every `half_life_s` seconds and is raised by 1 on each hit, so entries that keep earning hits
stay while one-off prompts fade; below `score_floor` an entry is deleted; `max_entries` is a hard
bound over all partitions, enforced by evicting the lowest score first. Pinned entries have no score:
they never decay and are never evicted, but they count toward the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class InvalidSemanticCacheConfig(ValueError):
    """A setting is out of range; the message names the field, the value and the allowed range."""


@dataclass(frozen=True)
class SemanticCacheConfig:
    threshold: float = 0.9  # cosine similarity in [0, 1]; a hit needs at least this much
    half_life_s: float = 3600.0  # an unused entry's score halves this often
    score_floor: float = 0.05  # entries whose decayed score falls below this are deleted
    max_entries: int = 10_000  # over all (model, tenant, params) partitions, pinned ones included
    ef_search: int = 64  # hnswlib query breadth: recall against latency
    ef_construction: int = 200
    m: int = 16  # hnswlib graph degree
    dim: int = 384  # embedding width (all-MiniLM-L6-v2)

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, (int, float)) and 0.0 <= self.threshold <= 1.0):
            raise InvalidSemanticCacheConfig(
                f"threshold must be a cosine similarity between 0 and 1 inclusive, got {self.threshold!r}")
        if not (math.isfinite(self.half_life_s) and self.half_life_s > 0):
            raise InvalidSemanticCacheConfig(f"half_life_s must be a positive number of seconds, "
                                             f"got {self.half_life_s!r}")
        if not (0.0 <= self.score_floor < 1.0):
            # A new entry starts at 1: a floor of 1 or more would delete it at once.
            raise InvalidSemanticCacheConfig(f"score_floor must be in [0, 1), got {self.score_floor!r}")
        for name in ("max_entries", "ef_search", "ef_construction", "m", "dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidSemanticCacheConfig(f"{name} must be a positive integer, got {value!r}")
