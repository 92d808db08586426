"""`x-ferry-speculation: off | auto`: a caller's say on speculative decoding for one request.

Mental model: speculation never changes what a greedy or seeded request produces, only how fast,
but a caller may still want none (a benchmark of the plain engine, a latency study): `off` keeps
the engines from drafting for that request; `auto` (or no header) leaves it to the engine, which
speculates where it pays. The Gate reads the header of every API request into the request's
`RequestPolicy` (policy.py; an unknown value is a 400 naming the header), together with the
tenant's own setting (`scheduler.tenants.<name>.speculation`): either one saying off wins.
"""

from __future__ import annotations

HEADER = "x-ferry-speculation"
VALUES = {"off": False, "auto": True}

def parse_speculation(value: str | None) -> bool | None:
    """The header's meaning: True (auto, or no header), False (off), None for any other value."""
    if value is None:
        return True
    return VALUES.get(value.strip().lower())
