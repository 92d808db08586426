"""`SemanticCacheStats`: what the cache reports; deploy/ maps it to metrics.

Mental model: counters only grow (lookups, hits, inserts, evictions by reason); `size` and
`num_pinned` are the present state; the histogram counts the best similarity each lookup found,
hit or miss, so an operator can see how close misses came to the threshold before moving it. The
embedding counters come from the worker, not the store: texts embedded over forwards run is the
mean batch size, which shows whether concurrent lookups really share a forward.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Upper edges of the similarity buckets; the last bucket ends at 1.0 inclusive.
SIMILARITY_EDGES: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0)


@dataclass
class SemanticCacheStats:
    num_lookups: int = 0
    num_hits: int = 0
    num_inserts: int = 0
    num_evicted_decay: int = 0  # fell below the score floor
    num_evicted_capacity: int = 0  # made room under max_entries
    num_refused_full: int = 0  # inserts refused: every entry pinned and the cache full
    size: int = 0
    num_pinned: int = 0
    num_embed_batches: int = 0  # embedding forwards run (lookups and inserts without a vector)
    num_embedded: int = 0  # texts embedded over those forwards
    similarity_histogram: list[int] = field(default_factory=lambda: [0] * len(SIMILARITY_EDGES))

    @property
    def num_evictions(self) -> int:
        return self.num_evicted_decay + self.num_evicted_capacity

    @property
    def hit_rate(self) -> float:
        return self.num_hits / self.num_lookups if self.num_lookups else 0.0

    def observe_similarity(self, similarity: float) -> None:
        i = bisect.bisect_left(SIMILARITY_EDGES, similarity)
        self.similarity_histogram[min(i, len(SIMILARITY_EDGES) - 1)] += 1

    def copy(self) -> "SemanticCacheStats":
        return SemanticCacheStats(**{**self.__dict__, "similarity_histogram": list(self.similarity_histogram)})
