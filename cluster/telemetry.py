"""TelemetryInbox: each worker's numbered telemetry, applied exactly once however it arrives.

Mental model: a worker numbers its engine steps and its prefix-cache changes; the inbox keeps,
per worker, the cursor of what the scheduler has applied (worker incarnation, last step, last
cache change). Ingresses relay a worker's telemetry read after that cursor (they get it in every
`ReportAck`), so two ingresses may relay overlapping windows, one may lag or repeat itself, and the
scheduler may have restarted: `accept` keeps only what lies after the cursor, takes a whole set
(`cached_full`) as the new truth, and refuses cache changes that leave a gap (the next read,
without a cursor, brings the whole set). Steps may have gaps: a regression loses nothing by a few
missing samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.descriptors import StepSample, WorkerName, WorkerTelemetry

Cursor = tuple[str, int, int]  # (incarnation, last step seq applied, last cache change applied)


@dataclass(slots=True)
class Accepted:
    """What is new in one `WorkerTelemetry`: steps, then either a whole set or changes in order."""

    steps: tuple[StepSample, ...] = ()
    cached_full: frozenset[int] | None = None
    changes: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)


class TelemetryInbox:
    def __init__(self) -> None:
        self._cursors: dict[WorkerName, Cursor] = {}

    def accept(self, t: WorkerTelemetry) -> Accepted:
        cur = self._cursors.get(t.name)
        same = cur is not None and cur[0] == t.incarnation
        step_seq, cache_seq = (cur[1], cur[2]) if same and cur is not None else (0, -1)
        out = Accepted()
        skip = max(0, step_seq + 1 - t.first_step_seq)
        if skip < len(t.steps):
            out.steps = t.steps[skip:]
            step_seq = t.first_step_seq + len(t.steps) - 1
        if t.cached_full is not None:
            if t.cache_seq > cache_seq or not same:
                out.cached_full, cache_seq = t.cached_full, t.cache_seq
        elif cache_seq >= 0:  # changes only extend a set this inbox has
            for seq, added, removed in t.cache_changes:
                if seq == cache_seq + 1:
                    out.changes.append((added, removed))
                    cache_seq = seq
                elif seq > cache_seq + 1:
                    break  # a gap: wait for a whole set
        self._cursors[t.name] = (t.incarnation, step_seq, cache_seq)
        return out

    def cursors(self) -> dict[str, Cursor]:
        """Per worker, where its next telemetry should start (a cache seq of -1: this inbox holds
        none of its cache yet, so the worker sends the whole set)."""
        return dict(self._cursors)

    def drop(self, name: WorkerName) -> None:
        self._cursors.pop(name, None)
