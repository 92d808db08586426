"""A graceful stop: refuse new work, let the requests in flight finish, then report.

Mental model: `DrainGate` is ASGI middleware on the outside of the app, sharing one `DrainState`.
It counts the requests in flight under /v1/ (a streamed answer counts until its last byte has
been sent, or its client left). `await state.drain(timeout_s)` switches to draining: from then on
a new /v1/ request gets 503 `server_shutting_down` with Retry-After, and /health answers 503 with
`"draining": true` so a load balancer stops sending here; it returns when nothing is in flight, or
when the timeout passes, with the number still in flight (which the stop that follows cuts).
Draining is one-way: the app is about to go. The state is read from other threads and event
loops only through an int and a bool, so `drain` may run on any loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from deploy.openai.errors import ApiError
from deploy.openai.gate import route_path

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5


class DrainState:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Stops new /v1/ requests; waits up to `timeout_s` for those in flight; returns how many
        are still in flight (0: all finished)."""
        if not self.draining:
            self.draining = True
            logger.info("draining: no new requests; %d in flight, waiting up to %g s", self.in_flight, timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        return self.in_flight


class DrainGate:
    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if self.state.draining:
            if path.startswith("/v1/"):
                refusal = ApiError(503, "The server is shutting down; send the request again in a few seconds "
                                        "(to another replica, if there is one).", type="server_error",
                                   code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
                await refusal.response()(scope, receive, send)
                return
            if path == "/health":
                body = {"healthy": False, "draining": True, "in_flight": self.state.in_flight}
                await JSONResponse(body, status_code=503)(scope, receive, send)
                return
        if not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1
