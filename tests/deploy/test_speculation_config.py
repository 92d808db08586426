"""Speculative decoding in the app config: `engine.speculation` mapped to the engines' `SpecConfig`
(with clear errors), and each tenant's `speculation: off | auto` mapped to the router's setting."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from actors.engine.spec import SpecConfig
from deploy.config import ConfigError, load_config
from deploy.scheduler_config import SchedulerSection


def test_the_app_speculates_by_ngram_by_default() -> None:
    # The engine's own default is off (a bare Engine); the app's is n-gram lookup under the auto
    # policy, which drafts only where it pays (README: Speculative decoding, bench.serve figures).
    engine = load_config({}).to_engine_config()
    assert engine.speculation == SpecConfig(method="ngram") and engine.speculation.policy == "auto"
    assert SpecConfig().method == "off"


def test_every_field_of_the_block_maps_to_the_engines_spec_config(tmp_path: Path) -> None:
    (tmp_path / "app.yaml").write_text(
        "engine:\n"
        "  speculation:\n"
        "    method: draft\n"
        "    max_draft_tokens: 6\n"
        "    ngram_max: 5\n"
        "    ngram_min: 3\n"
        "    exit_layer: 7\n"
        "    draft_model: /models/tiny.gguf\n"
        "    sample_drafts: true\n"
        "    policy: always\n")
    cfg = load_config(tmp_path / "app.yaml")
    want = SpecConfig(method="draft", max_draft_tokens=6, ngram_max=5, ngram_min=3, exit_layer=7,
                      draft_model="/models/tiny.gguf", sample_drafts=True, policy="always")
    assert cfg.to_engine_config().speculation == want
    assert cfg.to_worker_config().engine.speculation == want  # what every worker's engine gets
    ngram = load_config({"engine": {"speculation": {"method": "ngram"}}}).to_engine_config().speculation
    assert (ngram.method, ngram.max_draft_tokens, ngram.ngram_min, ngram.ngram_max) == ("ngram", 4, 2, 4)


@pytest.mark.parametrize(("block", "message"), [
    ({"method": "medusa"}, "engine.speculation.method: Input should be 'off', 'ngram', 'early_exit' or 'draft'"),
    ({"method": "draft"}, "engine.speculation: Value error, method draft needs draft_model"),
    ({"method": "ngram", "ngram_min": 5}, "engine.speculation: Value error, ngram_min (5) is above ngram_max (4)"),
    ({"max_draft_tokens": 0}, "engine.speculation.max_draft_tokens: Input should be greater than or equal to 1"),
    ({"max_draft_tokens": 17}, "engine.speculation.max_draft_tokens: Input should be less than or equal to 16"),
    ({"exit_layer": 0}, "engine.speculation.exit_layer: Input should be greater than or equal to 1"),
    ({"policy": "never"}, "engine.speculation.policy: Input should be 'auto' or 'always'"),
    ({"k": 4}, "engine.speculation.k: Extra inputs are not permitted"),
])
def test_a_bad_block_is_refused_with_the_field_named(block: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config({"engine": {"speculation": block}})
    assert message in str(e.value)


def test_each_tenants_setting_becomes_its_requests_policy_and_a_callers_off_wins() -> None:
    from starlette.datastructures import Headers

    def speculates(section: SchedulerSection, tenant: str, header: str | None = None) -> bool:
        headers = Headers({} if header is None else {"x-ferry-speculation": header})
        return section.request_policies().resolve(tenant, headers).speculation

    section = SchedulerSection.model_validate(
        {"tenants": {"quiet": {"speculation": "off"}, "chat": {}}})
    assert [speculates(section, t) for t in ("quiet", "chat", "someone")] == [False, True, True]
    assert not speculates(section, "chat", "off") and not speculates(section, "quiet", "auto")
    off = SchedulerSection.model_validate(
        {"default_tenant": {"speculation": "off"},
         "tenants": {"fast": {"speculation": "auto"}, "quiet": {"speculation": "off"}}})
    assert [speculates(off, t) for t in ("fast", "quiet", "someone")] == [True, False, False]
    assert speculates(SchedulerSection.model_validate({"default_tenant": None}), "anyone")
    with pytest.raises(ValidationError, match="speculation"):
        SchedulerSection.model_validate({"tenants": {"a": {"speculation": "on"}}})


def test_kv_paging_section_maps_to_the_engine():
    from actors.engine.paging import PagingPolicy

    cfg = load_config({"engine": {"kv_paging": {"mode": "request_aware", "long_tokens": 2048, "run_blocks": 16}}})
    assert cfg.to_engine_config().kv_paging == PagingPolicy("request_aware", 2048, 16, False)
    assert load_config({}).to_engine_config().kv_paging == PagingPolicy()
    with pytest.raises(ConfigError, match="mode"):
        load_config({"engine": {"kv_paging": {"mode": "eager"}}})
