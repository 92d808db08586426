"""KV compression as configured: `transfer.compression` (auto by default) and each tenant's
`kv_compression` reach the prefill workers' WorkerConfig, and bad values are refused by name."""

from __future__ import annotations

import pytest

from actors.worker_config import WorkerConfig
from deploy.config import AppConfig, ConfigError, load_config
from deploy.scheduler_config import SchedulerSection
from transfer.codec import Compression

ALL = (Compression.NONE, Compression.INT8, Compression.FP8)


def worker(app: dict[str, object], scheduler: dict[str, object]) -> WorkerConfig:
    return load_config(app).to_worker_config(None, **SchedulerSection.model_validate(scheduler).kv_compression())  # type: ignore[arg-type]


def test_auto_is_the_default_everywhere() -> None:
    assert AppConfig().transfer.compression == "auto"
    assert WorkerConfig(model="m").compression == "auto"
    cfg = worker({}, {})
    assert cfg.compression == "auto" and cfg.codecs_for("anyone") == ALL


def test_tenant_policy_wins_and_unlisted_tenants_follow_the_default_tenant() -> None:
    cfg = worker({"transfer": {"compression": "int8"}},
                 {"tenants": {"bank": {"kv_compression": "none"}, "lab": {"kv_compression": "fp8"},
                              "free": {"kv_compression": "auto"}},
                  "default_tenant": {"kv_compression": "none"}})
    assert cfg.codecs_for("bank") == (Compression.NONE,)  # exact KV required, whatever the worker's setting
    assert cfg.codecs_for("lab") == (Compression.FP8,)
    assert cfg.codecs_for("free") == (Compression.INT8,)  # auto defers to transfer.compression
    assert cfg.codecs_for("someone-else") == (Compression.NONE,)
    refused = worker({}, {"default_tenant": None, "tenants": {"a": {}}})
    assert refused.default_tenant_compression == "auto" and refused.codecs_for("a") == ALL


def test_bad_values_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="transfer.compression"):
        load_config({"transfer": {"compression": "zstd"}})
    with pytest.raises(ValueError, match="kv_compression"):
        SchedulerSection.model_validate({"tenants": {"a": {"kv_compression": "lossy"}}})
    with pytest.raises(ValueError, match="auto, none, int8, fp8"):
        WorkerConfig(model="m", compression="zstd")
    with pytest.raises(ValueError, match="unknown KV compression policy 'gzip'"):
        WorkerConfig(model="m", tenant_compression=(("a", "gzip"),))
