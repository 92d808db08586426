"""What operators hang on the HTTP app without wrapping its backend: request observers and /health parts.

Mental model: the app owns one `AppHooks` (`app.state.hooks`). Each backend stream an endpoint
runs passes `observed`, which, once the stream has ended (finished, aborted, failed), hands the
request's timeline (`backend.timeline(request_id)`) to every observer's `on_finished`; a refusal
(`actors.errors.Refused`) reaches their `on_refused(tenant, reason)` where the app maps it to
HTTP. `deploy/dashboard/monitoring.Monitoring.mount` adds the metrics as an observer and the
dashboard's SLO attainment as the `slo` part of `/health`; the MoE ingress adds `moe`. A part is
a callable returning a JSON-able dict (or an awaitable of one); one that fails is logged and left
out, never an unhealthy app, and an observer that fails never fails a request.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from actors.engine.output import RequestOutput
from actors.errors import Refused

logger = logging.getLogger(__name__)

_REASON = re.compile(r"[a-z][a-z0-9_]{0,47}")
HealthPart = Callable[[], "dict[str, Any] | Awaitable[dict[str, Any]]"]


def refusal_reason(e: Refused) -> str:
    """A bounded label value: the reason if it is a short identifier (every refusal ferry makes
    uses one), else "other"."""
    return e.reason if _REASON.fullmatch(e.reason) else "other"


class RequestObserver(Protocol):
    def on_finished(self, timeline: dict[str, Any]) -> None: ...

    def on_refused(self, tenant: str, reason: str) -> None: ...


@dataclass
class AppHooks:
    observers: list[RequestObserver] = field(default_factory=list)
    health_parts: dict[str, HealthPart] = field(default_factory=dict)

    async def observed(self, stream: AsyncGenerator[RequestOutput, None], request_id: str,
                       timeline: Callable[[str], dict[str, Any] | None] | None) -> AsyncGenerator[RequestOutput, None]:
        """`stream` as it is, telling the observers about the request once it has ended (only when it
        produced output: a refused or cancelled request has no timeline). Closing this closes
        `stream` at once (aclosing), which aborts the request."""
        started = False
        try:
            async with aclosing(stream) as inner:
                async for out in inner:
                    started = True
                    yield out
        finally:
            if started and self.observers and timeline is not None:
                self._finished(request_id, timeline)

    def _finished(self, request_id: str, timeline: Callable[[str], dict[str, Any] | None]) -> None:
        try:
            found = timeline(request_id)
            if found is not None:
                for observer in self.observers:
                    observer.on_finished(found)
        except Exception:  # a metrics bug must never fail a request
            logger.exception("cannot record the end of %s", request_id)

    def refused(self, tenant: str, refusal: Refused) -> None:
        for observer in self.observers:
            try:
                observer.on_refused(tenant, refusal_reason(refusal))
            except Exception:
                logger.exception("cannot record a refusal of tenant %s", tenant)

    async def health(self, report: dict[str, Any]) -> dict[str, Any]:
        """`report` (the backend's) with every part added under its name."""
        for name, part in self.health_parts.items():
            try:
                value = part()
                report[name] = await value if inspect.isawaitable(value) else value
            except Exception:  # detail only: a figures bug must not make a healthy backend look down
                logger.exception("cannot compute the %s part of /health", name)
        return report
