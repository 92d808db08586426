"""Named failures of the data plane: the expected events a caller of the workers must handle.

Each is raised where the event is detected and crosses Ray unchanged (Ray re-raises a remote
exception as a subclass of the original class, so `except KVNotArrived` works on the caller).
Bad input keeps the engine's own `InvalidRequest` family.

`Refused` is the one refusal type of the whole request path: a decode worker with no room
(`NoCapacity`), a router with no healthy worker (`NoWorkers`), the scheduler's admission (over
budget, SLO unattainable, unknown tenant, too large: `cluster/admission.py`) all raise it, and
`deploy/openai/errors.to_api_error` is the one place that turns it into an HTTP answer.
"""

from __future__ import annotations


class DataPlaneError(Exception):
    """Base of the data plane's expected failures. One message argument, so they pickle."""


class Refused(DataPlaneError):
    """The serving system will not take the request now, and says why. `reason` is a short code
    (`no_capacity`, `slo_unattainable`, `tenant_over_budget`, ...); `status` the HTTP status it
    maps to (429 for a matter of waiting, 403 unknown tenant, 413 too large, 503 no healthy
    worker); `retry_after_s` when to come back (None: retrying cannot help); `predicted_wait_s` an
    SLO refusal's predicted queueing before the request would have started."""

    def __init__(self, reason: str, detail: str = "", *, status: int = 429, retry_after_s: float | None = None,
                 predicted_wait_s: float | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        self.status = status
        self.retry_after_s = retry_after_s
        self.predicted_wait_s = predicted_wait_s

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_refused, (type(self), self.reason, self.detail, self.status, self.retry_after_s,
                           self.predicted_wait_s))


def _refused(cls: type[Refused], reason: str, detail: str, status: int, retry_after_s: float | None,
             predicted_wait_s: float | None) -> Refused:
    e = Exception.__new__(cls)
    Refused.__init__(e, reason, detail, status=status, retry_after_s=retry_after_s, predicted_wait_s=predicted_wait_s)
    return e


RETRY_SOON_S = 1.0  # when a refusal for lack of room or workers tells the client to come back


class NoCapacity(Refused):
    """No decode worker could reserve KV blocks (or a batch slot) for the request now."""

    def __init__(self, detail: str = "") -> None:
        super().__init__("no_capacity", detail, status=429, retry_after_s=RETRY_SOON_S)


class NoWorkers(Refused):
    """No healthy worker of a kind the request needs is known (all down, or none started yet)."""

    def __init__(self, detail: str = "") -> None:
        super().__init__("no_workers", detail, status=503, retry_after_s=RETRY_SOON_S)


class KVNotArrived(DataPlaneError):
    """A decode worker announced a request, but its KV did not land before the lease ran out; the
    reserved blocks were freed."""


class HandoffFailed(DataPlaneError):
    """KV arrived but could not be used (corrupt, wrong layout, wrong block count); blocks freed."""


class RequestAborted(DataPlaneError):
    """The request was aborted (caller gone, prefill failed) before it finished."""


class UnknownRequest(DataPlaneError):
    """A stream was asked for a request the worker does not hold (never announced, or expired)."""


class WorkerTimeout(DataPlaneError, TimeoutError):
    """A remote call to a worker did not answer within its deadline."""


class EngineDead(RuntimeError):
    """The engine's stepping thread crashed; the worker serves nothing until it is replaced."""
