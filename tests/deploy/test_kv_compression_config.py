"""KV compression and fidelity as configured: `transfer.compression` (auto by default) and each
tenant's `kv_compression` / `kv_fidelity` reach the workers' WorkerConfig; exact is the default
everywhere, a lossy codec needs a tenant's opt-in, and bad values are refused by name."""

from __future__ import annotations

import pytest

from actors.engine.config import EngineConfig
from actors.worker_config import TenantKVPolicy, WorkerConfig
from deploy.config import AppConfig, ConfigError, load_config
from deploy.scheduler_config import SchedulerSection
from transfer.codec import Compression
from transfer.codec_choice import LossyCodecForExactTenant

NONE, ZSTD, INT8, FP8 = Compression.NONE, Compression.ZSTD, Compression.INT8, Compression.FP8
EXACT = (NONE, ZSTD)
ALL = (NONE, INT8, FP8, ZSTD)


def worker(app: dict[str, object], scheduler: dict[str, object]) -> WorkerConfig:
    return load_config(app).to_worker_config(None, SchedulerSection.model_validate(scheduler).worker_policies())


def test_auto_and_exact_are_the_default_everywhere() -> None:
    assert AppConfig().transfer.compression == "auto" and AppConfig().prefix_cache.compression == "none"
    assert WorkerConfig(model="m").compression == "auto"
    cfg = worker({}, {})
    assert cfg.compression == "auto" and cfg.codecs_for("anyone") == EXACT  # lossless only
    assert cfg.exact_kv("anyone") and cfg.pool_codec_for("anyone") == "none"
    assert SchedulerSection().worker_policies().default_tenant_kv.fidelity == "exact"


def test_tenant_policy_wins_and_unlisted_tenants_follow_the_default_tenant() -> None:
    cfg = worker({"transfer": {"compression": "int8"}, "prefix_cache": {"compression": "fp8"}},
                 {"tenants": {"bank": {"kv_compression": "none"}, "lab": {"kv_compression": "fp8", "kv_fidelity": "lossy"},
                              "free": {"kv_fidelity": "lossy"}, "packed": {"kv_compression": "zstd"}},
                  "default_tenant": {"kv_fidelity": "lossy"}})
    assert cfg.codecs_for("bank") == (NONE,)  # its own lossless codec, whatever the worker's setting
    assert cfg.codecs_for("packed") == (ZSTD,)
    assert cfg.codecs_for("lab") == (FP8,)
    assert cfg.codecs_for("free") == (INT8,)  # auto defers to transfer.compression
    assert cfg.codecs_for("someone-else") == (INT8,)
    # the pool's lossy codec is for lossy tenants' blocks only
    assert cfg.pool_codec_for("lab") == "fp8" and cfg.pool_codec_for("bank") == "none"
    assert not cfg.exact_kv("lab") and cfg.exact_kv("bank")
    lossy = worker({}, {"default_tenant": {"kv_fidelity": "lossy"}})
    assert lossy.codecs_for("anyone") == ALL  # the prediction decides among all four
    refused = worker({}, {"default_tenant": None, "tenants": {"a": {}}})
    assert refused.default_tenant_kv == TenantKVPolicy() and refused.codecs_for("a") == EXACT


def test_lossy_kv_for_an_exact_tenant_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="kv_fidelity: lossy"):
        SchedulerSection.model_validate({"tenants": {"a": {"kv_compression": "int8"}}})
    # a lossy transfer.compression while a tenant (here the default one) is exact
    with pytest.raises(LossyCodecForExactTenant, match=r"tenant \(default\): KV compression int8 is lossy"):
        worker({"transfer": {"compression": "int8"}}, {})
    with pytest.raises(LossyCodecForExactTenant, match="tenant bank"):
        worker({"transfer": {"compression": "fp8"}},
               {"tenants": {"bank": {}}, "default_tenant": {"kv_fidelity": "lossy"}})
    # int8 KV storage makes every tenant's KV lossy
    with pytest.raises(LossyCodecForExactTenant, match="kv_cache_dtype int8"):
        WorkerConfig(model="m", engine=EngineConfig(kv_cache_dtype="int8"))
    WorkerConfig(model="m", engine=EngineConfig(kv_cache_dtype="int8"),
                 default_tenant_kv=TenantKVPolicy(fidelity="lossy"))


def test_bad_values_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="transfer.compression"):
        load_config({"transfer": {"compression": "brotli"}})
    with pytest.raises(ValueError, match="kv_fidelity"):
        SchedulerSection.model_validate({"tenants": {"a": {"kv_fidelity": "approximate"}}})
    with pytest.raises(ValueError, match="auto, none, int8, fp8, zstd"):
        WorkerConfig(model="m", compression="brotli")
    with pytest.raises(ValueError, match="unknown KV compression policy 'gzip'"):
        TenantKVPolicy("gzip")
