"""Shared by the tests that run the whole Serve app: running it on loopback until it answers healthy."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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
        time.sleep(0.25)
    pytest.fail(f"the app did not become healthy in {timeout_s:g} s")


@contextmanager
def served_app(name: str, port: int, cfg: dict[str, Any], proxy_location: str = "EveryNode",
               **run_options: Any) -> Iterator[str]:
    """`deploy.apps.build_app(cfg)` served on 127.0.0.1:`port` as app `name`, healthy; its base URL.
    Deleted, and Serve shut down, on exit. Several nodes on one machine need `proxy_location`
    HeadOnly: every node's proxy would bind the same loopback port."""
    from ray import serve

    from deploy.apps import build_app

    serve.start(proxy_location=proxy_location, http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg), name=name, route_prefix="/", blocking=False, **run_options)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url)
        yield url
    finally:
        serve.delete(name)
        serve.shutdown()
