"""Shared by the tests that run the whole Serve app: waiting until it answers healthy."""

from __future__ import annotations

import time

import pytest


def wait_until_healthy(url: str, timeout_s: float = 300.0) -> None:
    """Until `url`/health answers 200 with `healthy` true (the workers found and answering)."""
    import httpx2

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx2.get(f"{url}/health", timeout=10)
            if r.status_code == 200 and r.json().get("healthy"):
                return
        except httpx2.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"the app did not become healthy in {timeout_s:g} s")
