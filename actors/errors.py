"""Named failures of the data plane: the expected events a caller of the workers must handle.

Each is raised where the event is detected and crosses Ray unchanged (Ray re-raises a remote
exception as a subclass of the original class, so `except KVNotArrived` works on the caller).
Bad input keeps the engine's own `InvalidRequest` family.
"""

from __future__ import annotations


class DataPlaneError(Exception):
    """Base of the data plane's expected failures. One message argument, so they pickle."""


class NoCapacity(DataPlaneError):
    """No decode worker could reserve KV blocks (or a batch slot) for the request now."""


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
