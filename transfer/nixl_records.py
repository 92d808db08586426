"""What the NIXL endpoint remembers between polling turns: open sends (sender side), requests
waiting for room and room granted (receiver side). Plain records; `NixlEndpoint` owns the logic.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Outgoing:
    """One `send` call. The caller thread copies shards into send staging segment by segment and
    reports progress through `shard_ready` (run by the worker); it may `finish` the send with a
    timeout. The worker does everything else."""

    send_id: int
    peer: str
    tag: int
    sizes: list[int]
    deadline: float
    local: dict[int, int] = field(default_factory=dict)  # shard -> send staging offset
    ready: dict[int, int] = field(default_factory=dict)  # shard -> bytes copied into staging
    posted: dict[int, int] = field(default_factory=dict)  # shard -> bytes handed to WRITEs
    written: dict[int, int] = field(default_factory=dict)  # shard -> bytes whose WRITE is done
    granted: dict[int, int] = field(default_factory=dict)  # shard -> receiver's room offset
    inflight: list[tuple[int, int, Any]] = field(default_factory=list)  # (shard, bytes, NIXL handle)
    done: set[int] = field(default_factory=set)
    error: Exception | None = None
    finished: threading.Event = field(default_factory=threading.Event)
    cleaned: bool = False
    last_progress: float = 0.0
    last_ping: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def finish(self, error: Exception | None) -> bool:
        """First call wins; returns whether this call finished it."""
        with self._lock:
            if self.finished.is_set():
                return False
            self.error = error
            self.finished.set()
            return True


@dataclass(frozen=True)
class RoomRequest:  # a REQ waiting for receive room
    peer: str
    send_id: int
    shard: int
    size: int


@dataclass
class Grant:  # receive room reserved for one shard of a peer's send
    peer: str
    send_id: int
    shard: int
    offset: int
    size: int
    granted_at: float
    received: int = 0  # bytes whose DATA notification arrived
