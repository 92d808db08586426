"""prefix_cache.eviction reaches each store's PrefixCacheConfig; value order is the default."""

from __future__ import annotations

import pytest

from deploy.config import ConfigError, load_config


def test_eviction_reaches_the_store_config_and_is_checked() -> None:
    cache = load_config({}).to_cache_config()
    assert cache is not None and cache.eviction == "value"
    cache = load_config({"prefix_cache": {"eviction": "lru"}}).to_cache_config()
    assert cache is not None and cache.eviction == "lru"
    with pytest.raises(ConfigError):
        load_config({"prefix_cache": {"eviction": "lfu"}})
