"""EventBuffer: the flight events an ingress has not sent to the scheduler yet, in order.

Token notices are coalesced: a request's tokens since its last other event are one TOKENS entry,
holding each token's time, kept in the place of its first token and filled in (sealed) when the
request's next event comes or when the buffer is taken for a report. So a stream of N tokens
costs one event per report round, and the scheduler still sees every token's time in order.
"""

from __future__ import annotations

from collections.abc import Collection

from cluster.descriptors import RequestId
from cluster.flights import EventKind, FlightEvent


class EventBuffer:
    def __init__(self) -> None:
        self._events: list[FlightEvent] = []  # TOKENS entries are placeholders until sealed
        self._token_times: dict[str, tuple[int, list[float]]] = {}  # rid -> (index in _events, times)

    def __len__(self) -> int:
        return len(self._events)

    def push(self, event: FlightEvent) -> None:
        self._seal(event.request_id)  # tokens so far go before this event, later ones after it
        self._events.append(event)

    def tokens(self, rid: str, num_tokens: int, t: float) -> None:
        entry = self._token_times.get(rid)
        if entry is None:
            self._token_times[rid] = (len(self._events), [t] * num_tokens)
            self._events.append(FlightEvent(EventKind.TOKENS, RequestId(rid)))
        else:
            entry[1].extend([t] * num_tokens)

    def drop(self, rids: Collection[str]) -> None:
        """Forgets the requests' events (a state taken now supersedes them)."""
        self._events = [e for e in self._events if e.request_id not in rids]
        self._token_times = {r: v for r, v in self._token_times.items() if r not in rids}
        where = {e.request_id: i for i, e in enumerate(self._events) if e.kind is EventKind.TOKENS}
        self._token_times = {r: (where[r], times) for r, (_, times) in self._token_times.items() if r in where}

    def take(self) -> list[FlightEvent]:
        """Every event, sealed, in order; the buffer is empty after."""
        for rid in list(self._token_times):
            self._seal(rid)
        events, self._events = self._events, []
        return events

    def _seal(self, rid: str) -> None:
        entry = self._token_times.pop(rid, None)
        if entry is not None:
            i, times = entry
            self._events[i] = FlightEvent(EventKind.TOKENS, RequestId(rid), times[-1], times=tuple(times))
