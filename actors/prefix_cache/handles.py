"""How the pool talks to one store: a `StoreHandle` starts a call, a `PendingCall` waits for it.

Mental model: split every remote call into "start" and "wait with a deadline", so the pool can
start calls on all owners first and then collect them against one shared deadline: the fan-out
costs the slowest owner, not the sum. Two implementations: `LocalStoreHandle` (a plain store in
this process; the call runs at once, which is what tests without Ray want) and `RayStoreHandle`
in `actor.py` (a Ray actor; the only place the pool's side touches Ray).

Contract for implementations: `call` never blocks on the store and never raises for a store
failure; `PendingCall.result(timeout_s)` returns the method's plain-data result, or raises
`StoreTimeout` when the deadline passes first, `StoreUnavailable` when the store is gone, or the
store's own exception. Arguments and results are str, bool, ints, bytes, lists and dicts only.
"""

from __future__ import annotations

import threading
from typing import Literal, Protocol

from actors.prefix_cache.store import PrefixCacheStore

StoreMethod = Literal["put", "get", "get_prefix", "match_prefix", "prefetch", "remove", "clear", "stats_dict",
                      "tenant_usage", "holdings"]


class StoreError(Exception):
    """A store could not answer; the pool turns this into misses, never a request failure."""


class StoreUnavailable(StoreError):
    """The store's process is gone (actor died, killed or unreachable)."""


class StoreTimeout(StoreError, TimeoutError):
    """The store did not answer before the call's deadline."""


class PendingCall(Protocol):
    def result(self, timeout_s: float) -> object:
        """Waits at most `timeout_s` seconds (0 = only if already done) for the call's result."""
        ...


class StoreHandle(Protocol):
    def call(self, method: StoreMethod, *args: object) -> PendingCall:
        """Starts `method(*args)` on the store and returns without waiting for the store."""
        ...


class _Finished:
    """A call that already ran: holds its result or the exception it raised."""

    def __init__(self, value: object = None, error: BaseException | None = None) -> None:
        self._value = value
        self._error = error

    def result(self, timeout_s: float) -> object:
        if self._error is not None:
            raise self._error
        return self._value


class LocalStoreHandle:
    """A plain `PrefixCacheStore` in this process. Calls run synchronously inside `call`, one at
    a time (a worker's offer, shadow and fetch threads share it), so there is no deadline to
    enforce; `fail()` makes it behave like a dead actor for tests and for taking a store out by hand."""

    def __init__(self, store: PrefixCacheStore) -> None:
        self.store = store
        self.failed = False
        self._lock = threading.Lock()

    def fail(self) -> None:
        self.failed = True

    def call(self, method: StoreMethod, *args: object) -> PendingCall:
        if self.failed:
            return _Finished(error=StoreUnavailable(f"store {self.store.store_id} was failed by hand"))
        try:
            with self._lock:
                return _Finished(value=getattr(self.store, method)(*args))
        except Exception as e:  # delivered at result(), like a remote error would be
            return _Finished(error=e)
