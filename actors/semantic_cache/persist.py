"""Saving a `SemanticStore` to a folder and loading it back after a restart.

Mental model: one hnswlib file per partition (`<key hash>.bin`, written by `save_index`, deleted
slots included so labels keep their meaning) plus one `manifest.json` naming every partition's key
and entries. Files are written under temporary names and renamed, the manifest last, so a crash
mid-save leaves the previous manifest pointing at complete files it wrote. Scores are stored with
their wall-clock refresh times: decay continues across the downtime. The default folder is
`$FERRY_HOME/semantic_cache`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from actors.engine.fetch import ferry_home
from actors.semantic_cache.config import SemanticCacheConfig
from actors.semantic_cache.entry import CacheKey, Entry
from actors.semantic_cache.index import VectorIndex
from actors.semantic_cache.store import Clock, Partition, SemanticStore

MANIFEST = "manifest.json"
_VERSION = 1


def default_cache_dir() -> Path:
    return ferry_home() / "semantic_cache"


def save_store(store: SemanticStore, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    for key, part in store.partitions.items():
        name = f"{key.file_stem()}.bin"
        part.index.save(folder / f"{name}.tmp")
        os.replace(folder / f"{name}.tmp", folder / name)
        parts.append({"model": key.model, "tenant": key.tenant, "params_key": key.params_key, "file": name,
                      "num_slots": part.index.num_slots, "next_id": part.next_id,
                      "entries": [e.to_json() for e in part.entries.values()]})
    manifest = {"version": _VERSION, "dim": store.cfg.dim, "partitions": parts}
    tmp = folder / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, folder / MANIFEST)


def load_store(cfg: SemanticCacheConfig, folder: Path, *, clock: Clock | None = None) -> SemanticStore:
    """The saved store, or an empty one when the folder holds none. Entries over `cfg.max_entries`
    (the bound was lowered) or already decayed are dropped by the first sweep."""
    store = SemanticStore(cfg, clock=clock) if clock is not None else SemanticStore(cfg)
    path = folder / MANIFEST
    if not path.exists():
        return store
    manifest = json.loads(path.read_text())
    if manifest.get("version") != _VERSION or manifest.get("dim") != cfg.dim:
        raise ValueError(f"{path}: saved with version {manifest.get('version')} and dim {manifest.get('dim')}, "
                         f"expected {_VERSION} and {cfg.dim}; move the folder away to start empty")
    for p in manifest["partitions"]:
        key = CacheKey(p["model"], p["tenant"], p["params_key"])
        index = VectorIndex(cfg, path=folder / p["file"], num_slots=p["num_slots"])
        entries = {e.entry_id: e for e in map(Entry.from_json, p["entries"])}
        store.partitions[key] = Partition(index, entries, p["next_id"])
    store.sweep()
    while len(store) > cfg.max_entries and store.eviction_order():
        key, entry_id = store.eviction_order()[0]
        store._delete(key, store.partitions[key], entry_id)
        store.stats.num_evicted_capacity += 1
    store._refresh_size()
    return store
