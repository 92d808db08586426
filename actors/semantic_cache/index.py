"""`VectorIndex`: one hnswlib cosine index for one partition, with deleted slots reused.

Mental model: hnswlib stores vectors under integer labels (our `EntryId`s) in a fixed number of
slots. Deleting only marks a slot (`mark_deleted`): the graph keeps it for navigation, queries skip
it, and the next `add` takes it over (`replace_deleted`), so capacity freed by eviction is reused
instead of growing the file. When no deleted slot is free the index doubles (`resize_index`). The
store, not this class, decides what to delete; this class only keeps the count of live labels.
"""

from __future__ import annotations

from pathlib import Path

import hnswlib
import numpy as np

from actors.semantic_cache.config import SemanticCacheConfig

_INITIAL_SLOTS = 64


class VectorIndex:
    def __init__(self, cfg: SemanticCacheConfig, *, path: Path | None = None, num_slots: int = 0) -> None:
        self.cfg = cfg
        self._index = hnswlib.Index(space="cosine", dim=cfg.dim)
        if path is not None:
            self._index.load_index(str(path), max_elements=num_slots, allow_replace_deleted=True)
        else:
            self._index.init_index(max_elements=_INITIAL_SLOTS, ef_construction=cfg.ef_construction, M=cfg.m,
                                   allow_replace_deleted=True)
        self._index.set_ef(cfg.ef_search)
        self._num_deleted = len(self._deleted_labels()) if path is not None else 0

    def _deleted_labels(self) -> list[int]:
        ids = self._index.get_ids_list()
        if not ids:
            return []
        # hnswlib has no "list deleted" call; a deleted label cannot be fetched.
        deleted = []
        for label in ids:
            try:
                self._index.get_items([label])
            except RuntimeError:
                deleted.append(label)
        return deleted

    @property
    def num_live(self) -> int:
        return self._index.get_current_count() - self._num_deleted

    @property
    def num_slots(self) -> int:
        return self._index.get_max_elements()

    def add(self, label: int, vector: np.ndarray) -> None:
        vec = np.asarray(vector, dtype=np.float32).reshape(1, self.cfg.dim)  # [1, dim]
        if self._num_deleted > 0:
            self._index.add_items(vec, [label], replace_deleted=True)
            self._num_deleted -= 1
            return
        if self._index.get_current_count() >= self._index.get_max_elements():
            self._index.resize_index(2 * self._index.get_max_elements())
        self._index.add_items(vec, [label])

    def delete(self, label: int) -> None:
        self._index.mark_deleted(label)
        self._num_deleted += 1

    def nearest(self, vector: np.ndarray, k: int) -> list[tuple[int, float]]:
        """Up to `k` live labels nearest to `vector`, as (label, cosine similarity), best first."""
        k = min(k, self.num_live)
        if k <= 0:
            return []
        vec = np.asarray(vector, dtype=np.float32).reshape(1, self.cfg.dim)
        labels, distances = self._index.knn_query(vec, k=k)  # [1, k] each; cosine distance = 1 - cos
        return [(int(label), float(1.0 - d)) for label, d in zip(labels[0], distances[0])]

    def save(self, path: Path) -> None:
        self._index.save_index(str(path))
