"""The whole Serve app with speculating decode engines (workers as deployments, the scheduler on):
the header and the tenant's setting reach the decode engine through the real ingress, the request
timeline shows `decode.spec`, `/health` each worker's speculation, and a bad header is a 400."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.serving import served_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PORT = 8331
ACME = {"Authorization": "Bearer sk-acme"}
QUIET = {"Authorization": "Bearer sk-quiet"}


def test_opt_outs_and_reports_through_the_serve_app(ray_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import httpx2

    from actors.engine.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny-spec", seed=0)
    cfg = {"model": str(model),
           "engine": {"dtype": "float32", "kv_cache_mib": 4, "torch_threads": 1,
                      "speculation": {"method": "early_exit", "max_draft_tokens": 3, "policy": "always"}},
           "prefix_cache": {"num_stores": 0}, "transfer": {"staging_mib": 8},
           "api": {"api_keys": {"sk-acme": "acme", "sk-quiet": "quiet"}},
           "scheduler": {"tenants": {"acme": {}, "quiet": {"speculation": "off"}}}}
    body = {"model": model.name, "prompt": "the ferry leaves the harbor at dawn", "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    with served_app("ferry-spec", PORT, cfg) as url:
        def run(headers: dict[str, str]) -> tuple[str, dict[str, object]]:
            r = httpx2.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
            assert r.status_code == 200, r.text
            timeline = httpx2.get(f"{url}/v1/requests/{r.json()['id']}/timeline", headers=headers, timeout=30)
            return r.json()["choices"][0]["text"], timeline.json()["decode"]["spec"]

        text, drafted = run(ACME)
        assert drafted["draft_tokens"] > 0  # type: ignore[operator]
        for headers in ({**ACME, "x-ferry-speculation": "off"}, QUIET):
            same, spec = run(headers)
            assert same == text and spec == {"draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None}
        bad = httpx2.post(f"{url}/v1/completions", json=body, headers={**ACME, "x-ferry-speculation": "sometimes"},
                          timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-ferry-speculation"
        workers = httpx2.get(f"{url}/health", timeout=30).json()["workers"]
        spec = {w["kind"]: w["speculation"] for w in workers.values()}
        assert spec["decode"]["method"] == "early_exit" and spec["decode"]["draft_tokens"] >= drafted["draft_tokens"]
        assert spec["prefill"]["draft_tokens"] == 0
