"""`x-ferry-speculation: off | auto`: a caller's say on speculative decoding for one request.

Mental model: speculation never changes what a greedy or seeded request produces, only how fast,
but a caller may still want none (a benchmark of the plain engine, a latency study): `off` keeps
the engines from drafting for that request; `auto` (or no header) leaves it to the engine, which
speculates where it pays. The Gate reads the header of every API request (an unknown value is a
400 naming the header) and sets a context variable for the request's task, which the backends
read when they build the engine request (`requested_speculation`). The tenant's own setting
(`scheduler.tenants.<name>.speculation`) is applied by the router; either one saying off wins.
"""

from __future__ import annotations

import contextvars

HEADER = "x-ferry-speculation"
VALUES = {"off": False, "auto": True}

_requested: contextvars.ContextVar[bool] = contextvars.ContextVar("ferry_speculation", default=True)


def parse_speculation(value: str | None) -> bool | None:
    """The header's meaning: True (auto, or no header), False (off), None for any other value."""
    if value is None:
        return True
    return VALUES.get(value.strip().lower())


def requested_speculation() -> bool:
    """Whether the caller of the request this task serves allows speculation (True by default)."""
    return _requested.get()


def request_speculation(allowed: bool) -> contextvars.Token[bool]:
    """Sets the caller's choice for this task and the tasks it starts; `reset` with the token."""
    return _requested.set(allowed)


def reset(token: contextvars.Token[bool]) -> None:
    _requested.reset(token)
