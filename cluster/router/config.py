"""The router's settings: its deadlines and queueing (`RouterConfig`), and its recovery (`RecoveryConfig`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    """The router's deadlines and queueing (cluster/router/client.py)."""

    call_timeout_s: float = 10.0  # announce, load, abort
    prefill_timeout_s: float = 60.0  # a whole prefill: queue, lookup, compute, send
    token_timeout_s: float = 60.0  # between two streamed events (the first waits for the prefill too)
    # More for the first event while the worker is up with requests queued for a row (follow.py).
    row_wait_s: float = 600.0
    load_ttl_s: float = 0.2  # how long polled worker loads are trusted
    # A new request that finds every decode row taken queues until nothing has moved for
    # `room_wait_s` (0: refuse at once), and never longer than `room_max_wait_s` in all (room.py).
    room_wait_s: float = 30.0
    room_max_wait_s: float = 300.0
    # With no decode worker up, a recovery resumes on a prefill worker until one is back.
    lend_prefill: bool = True

    def __post_init__(self) -> None:
        if min(self.call_timeout_s, self.prefill_timeout_s, self.token_timeout_s) <= 0 or self.load_ttl_s < 0:
            raise ValueError("timeouts must be positive and load_ttl_s >= 0")
        if self.room_wait_s < 0 or self.row_wait_s < 0 or self.room_max_wait_s < 0:
            raise ValueError("room_wait_s, room_max_wait_s and row_wait_s must be >= 0")


@dataclass(frozen=True)
class RecoveryConfig:
    """How the router recovers streams of dead workers and replaces them (cluster/router/rounds.py,
    cluster/router/replacement.py)."""

    gather_s: float = 1.0  # how long a round waits for the other victims of the same death
    issue_timeout_s: float = 5.0  # longest a round waits for one recovery to be issued before the next
    probe_timeout_s: float = 3.0  # deadline of the health probe of a suspect worker
    max_recoveries: int = 4  # worker failures per request; past it the failure reaches the caller
    retry_delay_s: float = 0.2  # before re-placing a request whose workers all look alive
    room_wait_s: float = 60.0  # a recovery that finds no decode worker with room retries this long
    resume_wait_s: float = 600.0  # a preempted request waits this long for the scheduler, then is placed here
    replace_wait_s: float = 120.0  # a recovery with no healthy worker waits this long for a replacement
    replace_attempts: int = 3  # tries at starting a dead worker's replacement before giving up
    replace_backoff_s: float = 2.0  # before the second try; doubled for each further one

    def __post_init__(self) -> None:
        if min(self.gather_s, self.issue_timeout_s, self.probe_timeout_s, self.retry_delay_s, self.room_wait_s,
               self.resume_wait_s, self.replace_wait_s, self.replace_backoff_s) < 0:
            raise ValueError("recovery timeouts must be >= 0")
        if self.max_recoveries < 0 or self.replace_attempts < 0:
            raise ValueError("max_recoveries and replace_attempts must be >= 0")
