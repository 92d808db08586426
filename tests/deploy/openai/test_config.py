"""`ApiConfig` rejects what cannot work; with auth off calls run as the default tenant; an unhealthy
backend turns `/health` into 503."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx2 as httpx
import pytest
from pydantic import ValidationError

from deploy.openai import ApiConfig, build_api
from tests.deploy.openai.conftest import Served, ServerThread, serve


def test_config_rejects_unknown_fields_and_locked_doors() -> None:
    with pytest.raises(ValidationError, match="api_key\n  Extra inputs are not permitted"):
        ApiConfig(api_key={"k": "t"})  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="auth_required is true but api_keys is empty"):
        ApiConfig()
    with pytest.raises(ValidationError, match="served_model_names has duplicates"):
        ApiConfig(auth_required=False, served_model_names=["a", "a"])
    with pytest.raises(ValidationError, match="max_body_bytes\n  Input should be greater than 0"):
        ApiConfig(auth_required=False, max_body_bytes=0)
    assert ApiConfig(auth_required=False).max_body_bytes == 1 << 20
    assert "sk-secret" not in repr(ApiConfig(api_keys={"sk-secret": "acme"}))  # keys never reach a log line


def test_auth_off_uses_default_tenant(served: Served) -> None:
    cfg = ApiConfig(auth_required=False, api_keys={"key-b": "tenant-b"}, default_tenant="demo")
    body = {"model": "tiny", "prompt": "The ferry", "max_tokens": 1}
    with serve(served.backend, cfg) as server, httpx.Client(base_url=server.base_url, timeout=30) as http:
        anonymous = http.post("/v1/completions", json=body)
        keyed = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer key-b"})
        assert (anonymous.status_code, keyed.status_code) == (200, 200)
        assert served.backend.timeline(anonymous.headers["x-request-id"])["tenant"] == "demo"  # type: ignore[index]
        assert served.backend.timeline(keyed.headers["x-request-id"])["tenant"] == "tenant-b"  # type: ignore[index]


class SickBackend:
    """Just enough of a Backend for /health: one that reports itself unhealthy, or hangs."""

    def __init__(self, served: Served, mode: str) -> None:
        self._inner = served.backend
        self.mode = mode
        self.model_name = "tiny"
        self.max_model_len = self._inner.max_model_len
        self.tokenizer = self._inner.tokenizer

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.generate(*args, **kwargs)

    async def health(self) -> dict[str, Any]:
        if self.mode == "hang":
            await asyncio.sleep(60)
        return {"healthy": False, "engine_loop": "failed"}


@pytest.mark.parametrize("mode,body", [("unhealthy", {"healthy": False, "engine_loop": "failed"}),
                                       ("hang", {"healthy": False, "error": "TimeoutError"})])
def test_unhealthy_backend_is_503(served: Served, mode: str, body: dict[str, Any]) -> None:
    cfg = ApiConfig(auth_required=False, health_timeout_s=0.2)
    with ServerThread(build_api(SickBackend(served, mode), cfg)) as server:  # type: ignore[arg-type]
        r = httpx.get(f"{server.base_url}/health", timeout=10)
    assert (r.status_code, r.json()) == (503, body)
